"""Data pipeline: the embedded corpus, tasks end to end, packing, host sharding, exact resume,
t5xv-data, and the errors for bad input."""
import dataclasses
import os
import subprocess
import sys

import gin
import numpy as np
import pytest

from conftest import NO_DATA_LAYER

seqio = pytest.importorskip('seqio', reason=NO_DATA_LAYER)

from t5x_variants.data import corpus, pipeline, span_corruption, tasks, vocab  # noqa: E402
from t5x_variants.cli.data import default_lengths, main as data_main  # noqa: E402
from t5x_variants.data.config import DatasetConfig  # noqa: E402

SC_LENGTHS = {'inputs': 64, 'targets': span_corruption.input_and_target_lengths(64)[1]}


def test_embedded_corpus_is_real_prose_split_stably():
  docs = corpus.harvest_stdlib_prose()
  assert len(docs) > 3000 and sum(len(d.split()) for d in docs) > 100_000
  assert all('\n' not in d for d in docs[:100])
  train = list(corpus.read_documents([corpus.embedded_corpus_file()], 'train'))
  validation = list(corpus.read_documents([corpus.embedded_corpus_file()], 'validation'))
  assert not set(train) & set(validation)
  assert 0.02 < len(validation) / (len(train) + len(validation)) < 0.08


def _take(iterator, n):
  return [next(iterator) for _ in range(n)]


def test_iterator_resume_gives_the_batches_of_an_uninterrupted_run(tmp_path):
  make = lambda: pipeline.batches('embedded_span_corruption', SC_LENGTHS, 'encoder_decoder',
                                  global_batch_size=4, seed=3)
  straight = _take(make(), 6)
  first = make()
  _take(first, 3)
  prefix = first.save(str(tmp_path / 'iterator'))
  resumed = make()
  resumed.restore(prefix)
  for a, b in zip(_take(resumed, 3), straight[3:]):
    assert a.keys() == b.keys()
    for k in a:
      np.testing.assert_array_equal(a[k], b[k])


def test_a_position_saved_with_other_batch_shapes_is_refused_before_reading(tmp_path):
  """Another batch size (or feature lengths) on resume: one ValueError naming both shapes when
  the position is restored (tf.data failed only at the first batch, after the run's files had
  been rewritten with the refused settings)."""
  make = lambda batch, lengths=SC_LENGTHS: pipeline.batches(
      'embedded_span_corruption', lengths, 'encoder_decoder', global_batch_size=batch, seed=3)
  saved = make(4)
  next(saved)
  prefix = saved.save(str(tmp_path / 'iterator'))
  with pytest.raises(ValueError, match=r"its batches had decoder_input_tokens int32\[4, 14\], this "
                     r"run's int32\[2, 14\] \(8 feature\(s\) differ: another batch size"):
    make(2).restore(prefix)
  with pytest.raises(ValueError, match=r"had encoder_input_tokens int32\[4, 64\], this run's "
                     r'int32\[4, 32\] \(3 feature'):
    make(4, {'inputs': 32, 'targets': 14}).restore(prefix)
  make(4).restore(prefix)  # the same shapes: restored


@pytest.fixture
def short_pairs_task():
  """A task of short byte-level (inputs, targets) texts, so that packing has work to do."""
  import tensorflow as tf
  texts = [f'question {i}' * (1 + i % 3) for i in range(50)]
  source = seqio.FunctionDataSource(
      lambda split, shuffle_files, seed=None: tf.data.Dataset.from_tensor_slices(
          {'inputs': texts, 'targets': [t.upper() for t in texts]}), splits=['train'])
  features = {k: seqio.Feature(seqio.ByteVocabulary(), add_eos=True) for k in ('inputs', 'targets')}
  seqio.TaskRegistry.add('test_short_pairs', source, output_features=features,
                         preprocessors=[seqio.preprocessors.tokenize,
                                        seqio.preprocessors.append_eos_after_trim])
  yield 'test_short_pairs'
  seqio.TaskRegistry.remove('test_short_pairs')


AUTOGRAPH_OR_NOT = """
import contextlib
import numpy as np
from t5x_variants.data import pipeline, tasks
without_autograph = tasks.without_autograph
def batches(context):
  tasks.without_autograph = context
  out = []
  for name, lengths, architecture in (
      ('embedded_span_corruption', {'inputs': 64, 'targets': 16}, 'encoder_decoder'),
      ('embedded_prefix_lm', {'inputs': 32, 'targets': 31}, 'prefix_lm'),
      ('embedded_lm', {'targets': 32}, 'decoder_only'),
      ('embedded_mlm', {'inputs': 32, 'targets': 32}, 'encoder_only')):
    it = pipeline.batches(name, lengths, architecture, 4, seed=1)
    out += [next(it) for _ in range(2)]
  return out + [next(pipeline.eval_batches('embedded_span_corruption', {'inputs': 64, 'targets': 16},
                                           'encoder_decoder', 4))]
reference = batches(contextlib.nullcontext)  # first: nothing yet let through unconverted
for a, b in zip(reference, batches(without_autograph), strict=True):
  assert a.keys() == b.keys()
  for k in a:
    np.testing.assert_array_equal(a[k], b[k], err_msg=k)
print('equal', len(reference))
"""


def test_preprocessors_traced_without_autograph_give_the_batches_autograph_gives():
  """tasks.without_autograph (the pipeline's default) against autograph everywhere, in a fresh
  process (TensorFlow remembers which functions it let through unconverted): the packed batches
  of the four objectives and the (unpacked) eval batches are identical."""
  out = subprocess.run([sys.executable, '-c', AUTOGRAPH_OR_NOT], capture_output=True, text=True)
  assert out.returncode == 0 and out.stdout.strip().endswith('equal 9'), out.stderr[-3000:]


def test_packed_encoder_decoder_batches_keep_segments_apart(short_pairs_task):
  batch = next(pipeline.batches(short_pairs_task, {'inputs': 64, 'targets': 64},
                                'encoder_decoder', global_batch_size=2, seed=0))
  for prefix in ('encoder', 'decoder'):
    seg, pos = batch[f'{prefix}_segment_ids'], batch[f'{prefix}_positions']
    for s_row, p_row in zip(seg, pos):
      for s in set(s_row[s_row > 0].tolist()):
        np.testing.assert_array_equal(p_row[s_row == s], np.arange((s_row == s).sum()))
  assert (batch['encoder_segment_ids'].max(axis=1) >= 2).all()  # short examples were packed
  # Each decoder segment starts from BOS (0) and is its targets shifted right.
  seg, inp, tgt = batch['decoder_segment_ids'], batch['decoder_input_tokens'], batch['decoder_target_tokens']
  for s_row, i_row, t_row in zip(seg, inp, tgt):
    for s in set(s_row[s_row > 0].tolist()):
      i, t = i_row[s_row == s], t_row[s_row == s]
      assert i[0] == 0 and (i[1:] == t[:-1]).all()
  assert (batch['decoder_loss_weights'] == (batch['decoder_target_tokens'] > 0)).all()


def test_hosts_get_disjoint_shares_that_make_up_the_whole_stream():
  """Documents are sharded over hosts before chunking: the hosts' rows are disjoint and together
  hold the unsharded stream's tokens, up to the partial chunk and batch each one drops."""
  import collections
  make = lambda host, hosts: pipeline.batches('embedded_lm', {'targets': 32}, 'decoder_only',
                                              global_batch_size=4, split='validation', shuffle=False,
                                              num_epochs=1, host_index=host, num_hosts=hosts)
  batches = lambda host, hosts: [b['decoder_target_tokens'] for b in make(host, hosts)]
  host0, host1, whole = batches(0, 2), batches(1, 2), batches(0, 1)
  assert host0[0].shape == (2, 32)
  rows = lambda bs: {tuple(r) for b in bs for r in b}
  assert not rows(host0) & rows(host1)
  tokens = lambda bs: collections.Counter(np.concatenate([b.ravel() for b in bs]).tolist())
  missing = tokens(whole) - (tokens(host0) + tokens(host1))
  assert sum(missing.values()) <= 2 * (2 * 32 + 32) + 4 * 32
  with pytest.raises(ValueError, match='not divisible'):
    pipeline.batches('embedded_lm', {'targets': 32}, 'decoder_only', 3, num_hosts=2)


@pytest.mark.parametrize('pack', [False, True])
def test_mlm_batches_weight_exactly_the_selected_positions(pack):
  batch = next(pipeline.batches('embedded_mlm', {'inputs': 64, 'targets': 64}, 'encoder_only',
                                global_batch_size=4, pack=pack, seed=0))
  w, inp, tgt = batch['encoder_loss_weights'], batch['encoder_input_tokens'], batch['encoder_target_tokens']
  assert 0.08 < w.sum() / (tgt > 0).sum() < 0.25
  assert (inp[w == 0] == tgt[w == 0]).all()  # unselected positions are untouched
  assert (inp[w == 1] != tgt[w == 1]).mean() > 0.6  # most selected ones are corrupted


@pytest.mark.parametrize('pack', [False, True])
def test_prefix_lm_rows_are_the_inputs_then_the_targets_with_the_loss_on_the_targets(pack):
  """seqio's prefix LM layout: each example (segment) is its inputs (with EOS) then its targets,
  shifted right behind 0; ``decoder_causal_attention`` covers the inputs and the position that
  reads their last token; the loss weights cover the targets only."""
  lengths = {'inputs': 64, 'targets': 16}
  prefix_lm = next(pipeline.batches('embedded_span_corruption', lengths, 'prefix_lm', 4, pack=pack, seed=0))
  pairs = next(pipeline.batches('embedded_span_corruption', lengths, 'encoder_decoder', 4, pack=pack, seed=0))
  assert prefix_lm['decoder_target_tokens'].shape == (4, 80)
  seg = prefix_lm.get('decoder_segment_ids', (prefix_lm['decoder_target_tokens'] > 0).astype(int))
  enc_seg = pairs.get('encoder_segment_ids', (pairs['encoder_input_tokens'] > 0).astype(int))
  dec_seg = pairs.get('decoder_segment_ids', (pairs['decoder_target_tokens'] > 0).astype(int))
  for r in range(4):
    for s in set(seg[r][seg[r] > 0].tolist()):
      inputs = pairs['encoder_input_tokens'][r][enc_seg[r] == s]
      targets = pairs['decoder_target_tokens'][r][dec_seg[r] == s]
      here = seg[r] == s
      np.testing.assert_array_equal(prefix_lm['decoder_target_tokens'][r][here], np.concatenate([inputs, targets]))
      n = len(inputs)
      np.testing.assert_array_equal(prefix_lm['decoder_input_tokens'][r][here][0], 0)
      np.testing.assert_array_equal(prefix_lm['decoder_causal_attention'][r][here], np.arange(here.sum()) <= n)
      np.testing.assert_array_equal(prefix_lm['decoder_loss_weights'][r][here], np.arange(here.sum()) >= n)
  with pytest.raises(ValueError, match='embedded_lm has targets only; a prefix LM reads inputs'):
    pipeline.get_dataset('embedded_lm', {'targets': 64}, 'prefix_lm')


def test_task_examples_of_a_random_preprocessor_are_the_same_at_every_call():
  """t5xv-infer and t5xv-eval's decoded examples of a span-corruption split: the same noise at
  every call (and on every process, which must agree on them); unseeded, each call masked anew."""
  task = tasks.get_task_or_mixture('embedded_span_corruption')
  first, second = (tasks.task_examples(task, 'validation', SC_LENGTHS, max_examples=3)
                   for _ in range(2))
  for a, b in zip(first, second, strict=True):
    np.testing.assert_array_equal(a['inputs'], b['inputs'])
    np.testing.assert_array_equal(a['targets'], b['targets'])


def validation_documents(task_name):
  """The tokens of each validation document of an embedded task, in order."""
  task = tasks.get_task_or_mixture(task_name)
  vocabulary = task.output_features['targets'].vocabulary
  texts = task.source.get_dataset('validation', shuffle=False).as_numpy_iterator()
  return [np.asarray(vocabulary.encode(ex['text'].decode())) for ex in texts]


def test_lm_objective_is_t5s_full_lm_eos_where_each_document_ends():
  """Causal LM as T5's ``full_lm``: the documents, each followed by EOS, joined and cut into
  chunks of the targets length; EOS had ended every chunk, mid-document, and no document."""
  length = 32
  stream = np.concatenate([np.append(doc, 1) for doc in validation_documents('embedded_lm')])
  chunks = tasks.task_examples(tasks.get_task_or_mixture('embedded_lm'), 'validation',
                               {'targets': length})
  assert len(chunks) == len(stream) // length
  np.testing.assert_array_equal(np.stack([c['targets'] for c in chunks]),
                                stream[:len(chunks) * length].reshape(-1, length))


def test_prefix_lm_objective_cuts_each_chunk_once_at_a_uniform_point():
  """T5's LM objective: an example's inputs then targets are a chunk of the documents' joined
  stream (no token lost, added or moved), each with EOS, cut after n tokens, n uniform over
  [1, L - 1] for chunks of L = inputs_length - 1."""
  chunk_length, n_examples = 15, 600
  examples = tasks.task_examples(tasks.get_task_or_mixture('embedded_prefix_lm'), 'validation',
                                 {'inputs': chunk_length + 1, 'targets': chunk_length},
                                 max_examples=n_examples)
  stream = np.concatenate(validation_documents('embedded_prefix_lm'))
  assert len(examples) == n_examples
  cuts = []
  for i, example in enumerate(examples):
    assert example['inputs'][-1] == 1 and example['targets'][-1] == 1
    np.testing.assert_array_equal(np.concatenate([example['inputs'][:-1], example['targets'][:-1]]),
                                  stream[i * chunk_length:(i + 1) * chunk_length])
    cuts.append(len(example['inputs']) - 1)
  counts = np.bincount(cuts, minlength=chunk_length)
  expected = n_examples / (chunk_length - 1)  # 42.9 a cut; the bounds are 4.5 standard deviations
  assert counts[0] == 0 and len(counts) == chunk_length
  assert (counts[1:] > expected / 3).all() and (counts[1:] < 3 * expected).all(), counts


def test_a_prefix_lm_row_carries_its_loss_on_the_inputs_too_when_asked():
  """``DatasetConfig.loss_on_targets_only=False`` (T5's language model on the LM objective): the
  loss weights cover the whole row; refused for a model whose rows hold no inputs."""
  lengths = {'inputs': 32, 'targets': 31}
  config = DatasetConfig(mixture_or_task_name='embedded_prefix_lm', task_feature_lengths=lengths,
                         batch_size=4)
  targets_only = next(pipeline.config_batches(config, 'prefix_lm'))
  whole = next(pipeline.config_batches(dataclasses.replace(config, loss_on_targets_only=False),
                                       'prefix_lm'))
  np.testing.assert_array_equal(whole['decoder_target_tokens'], targets_only['decoder_target_tokens'])
  np.testing.assert_array_equal(whole['decoder_loss_weights'], whole['decoder_target_tokens'] > 0)
  assert 0 < targets_only['decoder_loss_weights'].sum() < whole['decoder_loss_weights'].sum()
  with pytest.raises(ValueError, match='only a prefix LM holds inputs and targets in one row .this model: encoder_decoder.'):
    pipeline.get_dataset('embedded_prefix_lm', lengths, 'encoder_decoder', loss_on_targets_only=False)


def test_a_decoder_only_model_on_a_task_with_inputs_is_refused_not_fed_targets_alone():
  """LMFeatureConverter reads targets only: the inputs (a GLUE sentence, a corrupted span) would
  be dropped without a word, the model trained on labels or sentinels alone."""
  with pytest.raises(ValueError, match='embedded_span_corruption has inputs, which a decoder-only .*'
                                       'make it a prefix LM'):
    pipeline.get_dataset('embedded_span_corruption', {'targets': 114}, 'decoder_only')
  assert pipeline.get_dataset('embedded_lm', {'targets': 64}, 'decoder_only') is not None


@pytest.mark.parametrize('name, lengths', [('embedded_lm', {'targets': 64}),
                                           ('embedded_span_corruption', {'inputs': 64, 'targets': 16}),
                                           ('glue_rte', {'inputs': 64, 'targets': 4})])
def test_an_encoder_only_model_on_a_task_that_is_not_mlm_is_refused_saying_which_it_reads(name, lengths):
  """A bare KeyError ('inputs') or seqio's missing 'mlm_weights' before."""
  with pytest.raises(ValueError, match=f'{name} is not a masked-language-modelling task.*embedded_mlm.*'
                                       'glue_rte_cls'):
    pipeline.get_dataset(name, lengths, 'encoder_only')


@pytest.mark.parametrize('targets', [32, 128])
def test_mlm_targets_of_another_length_than_the_inputs_are_refused_before_the_first_batch(targets):
  """They failed in tf.data at the first batch ('encoder_target_tokens' has length ...)."""
  with pytest.raises(ValueError, match=f'the targets length {targets} is not the inputs length 64'):
    pipeline.get_dataset('embedded_mlm', {'inputs': 64, 'targets': targets}, 'encoder_only')


@pytest.mark.parametrize('name, preprocessor', [('embedded_span_corruption', 'span_corruption'),
                                                ('embedded_lm', 'lm'), ('embedded_prefix_lm', 'prefix_lm')])
def test_a_task_that_cuts_text_to_lengths_has_no_whole_examples(name, preprocessor):
  """(t5xv-eval with EVAL_FEATURE_LENGTHS=None: seqio's Evaluator refuses the same tasks)"""
  with pytest.raises(ValueError, match=f'{name} cannot be evaluated on whole examples: its '
                                       f'preprocessor {preprocessor} cuts the text'):
    tasks.whole_lengths(tasks.get_task_or_mixture(name), 'validation')


def test_feature_lengths_without_a_features_length_name_it():
  """'input' for 'inputs' was a KeyError from inside the span-corruption preprocessor."""
  with pytest.raises(ValueError, match=r"give none for inputs of embedded_span_corruption \(it "
                                       r"reads: inputs, targets\): set TASK_FEATURE_LENGTHS"):
    pipeline.get_dataset('embedded_span_corruption', {'input': 128, 'targets': 32}, 'encoder_decoder')


def test_t5xv_data_prints_examples_and_statistics(capsys):
  assert data_main(['--task=embedded_span_corruption', '--n=8']) == 0
  out = capsys.readouterr().out
  assert out.count('--- example') == 8 and '<extra_id_0>' in out and '</s>' in out
  stats = dict(line.split(': ') for line in out.split('--- statistics\n')[1].strip().splitlines())
  assert stats['mean_inputs_length'] == '512' and stats['mean_targets_length'] == '114'
  assert abs(float(stats['noise_fraction']) - 0.15) < 0.01
  assert abs(float(stats['mean_span_length']) - 3) < 0.5


def test_span_corruptions_noise_is_a_gin_binding(capsys):
  """``span_corruption.mean_noise_span_length`` (T5's Table 7; ByT5's 20) sets the spans and, with
  them, the targets length t5xv-data and the run's check expect: 512 inputs at mean span 10 are
  591 raw tokens, 99 targets (T5's helper's count), where mean span 3 gives 114."""
  assert data_main(['--task=embedded_span_corruption', '--n=8',
                    '--gin.span_corruption.mean_noise_span_length=10.0']) == 0
  out = capsys.readouterr().out
  stats = dict(line.split(': ') for line in out.split('--- statistics\n')[1].strip().splitlines())
  assert stats['mean_inputs_length'] == '512' and stats['mean_targets_length'] == '99'
  assert abs(float(stats['noise_fraction']) - 0.15) < 0.01
  assert stats['num_spans'] == str(8 * 9) and abs(float(stats['mean_span_length']) - 10) < 0.5


@pytest.mark.parametrize('argv,message', [
    (['--task=nope'], "unknown task or mixture 'nope'; registered: "),
    (['--task=glue_nosuch_local'], 'a task of local files is registered when the directory of its '
                                   'benchmark is set: GLUE_DIR, SUPER_GLUE_DIR, SQUAD_DIR'),
    (['--task=local_lm', '--gin.local_corpus_files.pattern="/nonexistent/dir"'], 'no .txt or .jsonl files match'),
    (['--task=embedded_span_corruption', '--inputs_length=2'], 'too short for span corruption'),
    (['--task=embedded_span_corruption', '--targets_length=100'], 'makes targets of 114 tokens, but the '
     'targets length is 100; set it to 114 or more (--targets_length, or the run\'s TASK_FEATURE_LENGTHS)'),
    (['--task=embedded_lm', '--targets_length=1'], 'leaves no room'),
    (['--task=embedded_prefix_lm', '--targets_length=100'], 'makes targets of up to 511 tokens'),
    (['--task=embedded_prefix_lm', '--inputs_length=2'], 'leaves no room to split a chunk'),
    (['--task=embedded_lm', '--gin.vocabulary.kind="file"', '--gin.vocabulary.path="/no/such.model"'],
     "existing SentencePiece .model file, got '/no/such.model'"),
    (['--task=embedded_lm', '--gin.vocabulary.path="/x.model"'],  # (was: the embedded one used)
     "vocabulary.path is read only with vocabulary.kind = 'file'"),
    (['--task=c4_span_corruption'], 'not prepared'),
    (['--task=embedded_lm', '--gin.vocabulary.kind="wordpiece"'], "unknown vocabulary kind 'wordpiece'"),
    (['--task=embedded_lm', '--n=-1'], '--n=-1 is out of range: it must be at least 1'),
    (['--task=embedded_lm', '--inputs_length=0'], '--inputs_length=0 is out of range'),
])
def test_bad_input_gives_one_clear_error(argv, message, capsys):
  with pytest.raises(SystemExit) as e:
    data_main(argv)
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert message in err and 'Traceback' not in err and 'In call to configurable' not in err
  assert len(err.strip().splitlines()) == 1 or 'Valid' in err


def test_tasks_registered_with_one_vocabulary_are_registered_again_with_another():
  """In one process (t5xv-quickstart's steps, a notebook, the tests), a command that binds another
  vocabulary got the tasks of the first one: registration was once per process. The vocabulary
  is gin's alone (one passed to register_tasks was undone by the next task lookup)."""
  import gin  # pylint: disable=g-import-not-at-top
  import seqio  # pylint: disable=g-import-not-at-top
  from t5x_variants.data import tasks, vocab  # pylint: disable=g-import-not-at-top
  embedded = vocab.vocabulary()
  output = lambda name: tasks.output_vocabulary(tasks.get_task_or_mixture(name))
  with pytest.raises(TypeError):
    tasks.register_tasks(embedded)  # pylint: disable=too-many-function-args
  try:
    tasks.register_tasks()
    assert output('embedded_lm') == embedded
    assert tasks.register_tasks() == []  # the same one: nothing again
    gin.parse_config("vocabulary.kind = 'bytes'")
    assert 'embedded_lm' in tasks.register_tasks()
    assert isinstance(output('embedded_lm'), seqio.ByteVocabulary)
    assert isinstance(output('glue_rte_cls'), seqio.ByteVocabulary)
  finally:
    gin.clear_config()
  assert output('embedded_lm') == embedded


def test_t5s_vocabulary_out_of_reach_is_one_line_naming_it_and_the_fix(tmp_path, monkeypatch, capsys):
  """vocabulary.kind = 't5' where T5's model cannot be read (offline; here a path that is not
  there, the same failure without a network): t5xv-data said only 'in user code:' (a tf.function's
  first line), t5xv-train TensorFlow's HTTP error."""
  from t5x_variants.data import vocab  # pylint: disable=g-import-not-at-top
  missing = str(tmp_path / 'sentencepiece.model')
  monkeypatch.setattr(vocab, 'T5_SPM_PATH', missing)
  with pytest.raises(SystemExit) as e:  # (the tasks registered again, with this vocabulary)
    data_main(['--task=embedded_lm', '--gin.vocabulary.kind="t5"'])
  err = capsys.readouterr().err
  assert e.value.code == 2 and err.count('\n') == 1, err
  assert err.startswith(f't5xv-data: error: the vocabulary {missing} cannot be read here ('), err
  assert err.rstrip().endswith("copy it where this machine can read it and set vocabulary.kind = "
                               "'file' and vocabulary.path to it, or use the default "
                               "vocabulary.kind = 'embedded'"), err


def test_a_run_file_given_to_t5xv_data_says_which_files_it_takes():
  """Was: "No configurable matching 'train'" alone, with no word of which gin files it takes. (In
  a process of its own: here the trainer's configurables may be registered by other tests.)"""
  out = subprocess.run([sys.executable, '-m', 't5x_variants.cli.data', '--task=embedded_span_corruption',
                        '--gin_file=gin/experiments/quickstart.gin'], capture_output=True, text=True,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  err = out.stderr
  assert out.returncode == 2 and err.count('\n') == 1, err
  assert "No configurable matching 'train'" in err and err.rstrip().endswith(
      "t5xv-data takes the data layer's gin files and bindings (vocabulary, local_corpus_files, "
      "span_corruption), not a run or experiment file or a run's config.gin: give its task and lengths as --task, "
      "--inputs_length and --targets_length"), err


def test_a_sentencepiece_model_without_t5s_special_ids_is_refused(tmp_path, capsys):
  """Was accepted: with SentencePiece's defaults (unk 0, eos 2) decoding waited for id 1 (``<s>``)
  and unknown pieces were weighted as padding."""
  import sentencepiece as spm  # pylint: disable=g-import-not-at-top
  (tmp_path / 'text.txt').write_text('\n'.join(f'line {i} of a tiny corpus about cats and dogs'
                                                for i in range(200)))
  spm.SentencePieceTrainer.train(input=str(tmp_path / 'text.txt'), model_prefix=str(tmp_path / 'd'),
                                 vocab_size=40, minloglevel=2)
  with pytest.raises(SystemExit):
    data_main(['--task=embedded_lm', '--gin.vocabulary.kind="file"',
               f'--gin.vocabulary.path="{tmp_path}/d.model"'])
  err = capsys.readouterr().err
  assert "has pad, eos and unk ids (-1, 2, 0), not T5's (0, 1, 2)" in err, err
  assert '--pad_id=0 --eos_id=1 --unk_id=2 --bos_id=-1' in err
  for name, content in (('bin.model', bytes(range(256)) * 4), ('empty.model', b'')):  # a traceback
    (tmp_path / name).write_bytes(content)
    gin.clear_config()  # (as between tests)
    with pytest.raises(SystemExit) as e:
      data_main(['--task=embedded_lm', '--gin.vocabulary.kind="file"',
                 f'--gin.vocabulary.path="{tmp_path}/{name}"'])
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert f'{name} is not a SentencePiece model (' in err and '--pad_id=0' in err, err


def test_a_sentencepiece_model_with_its_own_sentinels_gets_no_more(tmp_path):
  """mT5's model holds its 100 sentinels at the top (<extra_id_0> the last piece): 100 more were
  added, so an imported mT5's vocabulary had 100 ids more than its embedding and every command
  refused it."""
  import sentencepiece as spm  # pylint: disable=g-import-not-at-top
  from sentencepiece import sentencepiece_model_pb2  # pylint: disable=g-import-not-at-top
  (tmp_path / 'text.txt').write_text('\n'.join(f'line {i} of a tiny corpus about cats and dogs'
                                                for i in range(200)))
  spm.SentencePieceTrainer.train(input=str(tmp_path / 'text.txt'), model_prefix=str(tmp_path / 'd'),
                                 vocab_size=40, pad_id=0, eos_id=1, unk_id=2, bos_id=-1,
                                 minloglevel=2)
  proto = sentencepiece_model_pb2.ModelProto.FromString((tmp_path / 'd.model').read_bytes())
  for i in reversed(range(vocab.EXTRA_IDS)):
    piece = proto.pieces.add()
    piece.piece, piece.type = f'<extra_id_{i}>', piece.USER_DEFINED
  (tmp_path / 'mt5.model').write_bytes(proto.SerializeToString())
  plain = vocab.vocabulary('file', str(tmp_path / 'd.model'))
  own = vocab.vocabulary('file', str(tmp_path / 'mt5.model'))
  assert plain.vocab_size == own.vocab_size == 40 + vocab.EXTRA_IDS
  assert own.decode([own.vocab_size - 1]) == '<extra_id_0>'
  # its own are sentinels as the added ones are (span corruption's count, MLM's random ids)
  assert vocab.sentinels(plain) == vocab.sentinels(own) == vocab.EXTRA_IDS


def test_local_corpus_from_txt_and_jsonl(tmp_path, capsys):
  (tmp_path / 'a.txt').write_text('\n'.join(f'plain document number {i} about cats.' for i in range(300)))
  (tmp_path / 'b.jsonl').write_text('\n'.join(f'{{"text": "json document {i} about dogs."}}' for i in range(300)))
  files = corpus.local_corpus_files(str(tmp_path))
  assert [f.rsplit('/', 1)[1] for f in files] == ['a.txt', 'b.jsonl']
  docs = list(corpus.read_documents(files, 'train')) + list(corpus.read_documents(files, 'validation'))
  assert len(docs) == 600 and any('dogs' in d for d in docs)
  (tmp_path / 'bad.jsonl').write_text('{"body": 1}\n')
  with pytest.raises(corpus.CorpusError, match='bad.jsonl:1'):
    list(corpus.read_documents(corpus.local_corpus_files(str(tmp_path)), 'train'))


def test_documents_come_in_a_new_order_each_epoch_and_resume_exactly(tmp_path):
  """A local corpus's documents are shuffled anew each time seqio repeats the source (before, the
  first epoch's order came back every epoch), deterministically by seed, and a saved iterator
  resumes within the second epoch where the unbroken one goes on. Its state holds the
  permutation's seed and position (and what tf.data prefetched), not a shuffle buffer of every
  document: such a buffer's state takes about 220 bytes a document, 2.2 MB here."""
  import glob
  import os
  import tensorflow as tf
  (tmp_path / 'a.txt').write_text('\n'.join(f'document {i}' for i in range(10_000)))
  files = corpus.local_corpus_files(str(tmp_path))
  source = tasks._text_source(lambda: files)  # pylint: disable=protected-access
  make = lambda: iter(source.get_dataset('train', shuffle=True, seed=5).repeat(2))
  docs = [x['text'].numpy() for x in make()]
  n = len(docs) // 2
  first_epoch, second_epoch = docs[:n], docs[n:]
  assert sorted(first_epoch) == sorted(second_epoch) and first_epoch != second_epoch
  assert [x['text'].numpy() for x in make()] == docs
  first = make()
  _take(first, n + 3)
  path = tf.train.Checkpoint(iterator=first).write(str(tmp_path / 'iterator'))
  assert sum(os.path.getsize(f) for f in glob.glob(path + '*')) < 500_000
  resumed = make()
  tf.train.Checkpoint(iterator=resumed).read(path)
  assert [x['text'].numpy() for x in resumed] == docs[n + 3:]


def test_span_corruption_targets_length_follows_the_inputs_length(capsys):
  assert data_main(['--task=embedded_span_corruption', '--inputs_length=1024', '--n=4']) == 0
  out = capsys.readouterr().out
  assert 'mean_inputs_length: 1024' in out
  assert f'mean_targets_length: {span_corruption.input_and_target_lengths(1024)[1]}' in out
  # The prefix LM objective's longest targets: a chunk of inputs - 1 tokens less one, and EOS.
  assert default_lengths('c4_prefix_lm', 512) == {'inputs': 512, 'targets': 511}


@pytest.mark.parametrize('gin_file,kind', [('gin/runs/pretrain.gin', 't5'),
                                           ('gin/experiments/quickstart.gin', 'embedded'),
                                           ('gin/runs/finetune.gin', 't5')])
def test_t5s_recipe_tokenizes_with_t5s_vocabulary(gin_file, kind):
  """runs/pretrain.gin, T5's recipe, bound no vocabulary: its C4 run tokenized with the embedded
  4,100 ids for a model of 32,128 (the paper recipes bound T5's); the quickstart stays offline."""
  from t5x_variants.cli import recipe  # pylint: disable=g-import-not-at-top
  recipe.parse_recipe([gin_file, 'gin/models/t5_tiny.gin'],
                      ["MODEL_DIR = '/tmp/x'", "INITIAL_CHECKPOINT_PATH = '/tmp/y'"])
  assert gin.query_parameter('vocabulary.kind') == kind
