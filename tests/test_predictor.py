"""The Predictor of t5xv-infer / t5xv-eval: teacher-forced scoring against cached decoding, and a
decoder-only model prompted with a prefix of a language-modelling task's targets."""
import json

import numpy as np
import pytest

from conftest import needs_data_layer, tiny
from train_helpers import save_fresh_state
from t5x_variants.features import EOS_ID
from t5x_variants.train.predictor import DecodeOptions, Predictor, pad_tokens, prompted

PROMPTS = [[5, 6, 7], [8], [9, 10, 11, 12], []]


@pytest.mark.parametrize('arch', ['encoder_decoder', 'decoder_only', 'prefix_lm'])
def test_the_score_of_a_greedy_continuation_is_its_decoding_score(arch, tmp_path):
  """Greedy decoding sums the log-probabilities of its tokens through the KV cache, one step at a
  time; ``score`` computes log p(those tokens | inputs) in one full forward pass. They agree (a
  prefix LM's inputs end with EOS, as its training rows: both keep it, fully visible)."""
  prefix_lm = arch == 'prefix_lm'
  config = tiny(architecture='decoder_only' if prefix_lm else arch, vocab_size=50, prefix_lm=prefix_lm)
  save_fresh_state(config, tmp_path, seed=3)
  predictor = Predictor(config).load(str(tmp_path))
  inputs = pad_tokens([np.asarray(p + [EOS_ID] * prefix_lm) for p in PROMPTS], 6, 4)
  out, scores = predictor.predict(inputs, 5)
  np.testing.assert_allclose(predictor.score(inputs, out), scores, rtol=1e-5, atol=1e-5)
  other = np.where(out > 0, (out + 1) % 50, 0)  # another continuation scores lower than greedy
  assert (predictor.score(inputs, other) < scores).all()
  # Tokens after a target's EOS are not scored (the encoder-decoder's were)
  ended = np.zeros_like(out)
  ended[:, 0], ended[:, 1], ended[:, 2] = 7, EOS_ID, 9
  np.testing.assert_allclose(predictor.score(inputs, ended),
                             predictor.score(inputs, np.where(ended == 9, 0, ended)), rtol=1e-6)


@pytest.mark.parametrize('options, message', [
    (dict(num_beams=0), r'DecodeOptions.num_beams = 0 is out of range: it must be an integer >= 1'),
    (dict(top_k=51), r'DecodeOptions.top_k = 51 .* 0 \(none\) to the vocabulary size, 50'),
    (dict(top_p=0.0), r'DecodeOptions.top_p = 0.0 .* in \(0, 1\]'),
    (dict(temperature=-1.0), r'DecodeOptions.temperature = -1.0 .* >= 0'),
    (dict(method='nucleus'), r"DecodeOptions.method = 'nucleus' .* 'greedy' or 'sample' or 'beam'; "
                             r'set --gin.DecodeOptions.method'),
    (dict(num_decodes=2), r"DecodeOptions.num_decodes = 2 .* 1, or with method 'sample' any count"),
    (dict(method='beam', num_beams=2, num_decodes=3), r'DecodeOptions.num_decodes = 3 .* at most num_beams'),
    (dict(method='sample', num_decodes=0), r'DecodeOptions.num_decodes = 0 is out of range')])
def test_decoding_options_out_of_range_are_one_line_before_any_checkpoint(options, message):
  """(num_beams 0 failed after the checkpoint was read, in a reduction of JAX's with no identity)"""
  with pytest.raises(ValueError, match=message):
    Predictor(tiny(vocab_size=50), options=DecodeOptions(**options))


@pytest.mark.parametrize('method', ['sample', 'beam'])
def test_num_decodes_gives_each_example_its_decodes_best_first(method, tmp_path):
  """decode_examples with num_decodes 3: 'predictions' holds each example's decodes, best
  first (3 samples; up to 3 beams: a slot no finished beam filled is left out), a sample scored
  by its own log p (``score``); 'prediction' and 'score' are the first's."""
  from t5x_variants.train.predictor import decode_examples  # pylint: disable=g-import-not-at-top
  config = tiny(vocab_size=50)
  save_fresh_state(config, tmp_path, seed=3)
  predictor = Predictor(config, options=DecodeOptions(method=method, num_decodes=3)).load(str(tmp_path))
  vocab = type('Ids', (), {'decode': staticmethod(lambda ids: ' '.join(map(str, ids)))})
  examples = [{'inputs': np.asarray(p + [EOS_ID], np.int32)} for p in PROMPTS[:3]]
  decoded = decode_examples(predictor, vocab, examples, 6, 5, 2)
  for ex in decoded:
    assert (len(ex['predictions']) == 3 if method == 'sample' else 1 <= len(ex['predictions']) <= 3)
    assert ex['predictions'][0]['prediction'] == ex['prediction']
    scores = [d['score'] for d in ex['predictions']]
    assert scores == sorted(scores, reverse=True) and scores[0] == ex['score']
  if method == 'sample':  # unnormalised: each sample's score is its log p
    ids = [[int(t) for t in d['prediction'].split()] for d in decoded[0]['predictions']]
    targets = pad_tokens([np.asarray(i + [EOS_ID] * (len(i) < 5)) for i in ids], 5, 3)
    np.testing.assert_allclose(predictor.score(np.repeat(pad_tokens([examples[0]['inputs']], 6, 1), 3, 0),
                                               targets), [d['score'] for d in decoded[0]['predictions']],
                               rtol=1e-4, atol=1e-4)


def test_prompted_cuts_the_targets_into_prompt_and_continuation():
  examples = [{'targets': np.array([5, 6, 7, 8, EOS_ID, 0])}, {'targets': np.array([5, 6, 7, EOS_ID, 0, 0])},
              {'targets': np.array([5, 6, 7, 8, 9, 10])},  # trimmed to length: no EOS
              {'targets': np.array([0, 0, 0])}]  # empty (an IndexError before)
  got = prompted(examples, 3)
  assert [(e['inputs'].tolist(), e['targets'].tolist()) for e in got] == [
      ([5, 6, 7], [8, EOS_ID]), ([5, 6, 7], [8, 9, 10])]  # the second has nothing to continue
  with_inputs = [{'inputs': np.array([4]), 'targets': np.array([5])}]
  assert prompted(with_inputs, 3) is with_inputs
  with pytest.raises(ValueError, match='embedded_lm has no inputs length.*--gin.PROMPT_LENGTH=32'):
    prompted(examples, None, 'embedded_lm')


@needs_data_layer
@pytest.mark.slow
def test_infer_and_eval_prompt_a_decoder_only_model_on_a_language_modelling_task(tmp_path):
  """t5xv-infer writes the prompt, the reference continuation, the prediction and the
  reference's log-likelihood; t5xv-eval adds the continuation metrics to the teacher-forced ones."""
  from t5x_variants.cli import eval as eval_cli, infer  # pylint: disable=g-import-not-at-top
  from t5x_variants.data import tasks  # pylint: disable=g-import-not-at-top
  config = tiny(architecture='decoder_only', vocab_size=4224)
  save_fresh_state(config, tmp_path / 'run', seed=0, step=2)
  lengths = {'targets': 24}
  out = tmp_path / 'predictions.jsonl'
  n = infer.infer(config, checkpoint_path=str(tmp_path / 'run'), output_file=str(out),
                  mixture_or_task_name='embedded_lm', task_feature_lengths=lengths, batch_size=4,
                  max_examples=6, prompt_length=8)
  records = [json.loads(line) for line in out.read_text().splitlines()]
  # of the first 6 rows, those whose first document goes on after the prompt (an EOS in the
  # first 9 tokens: the rest of a document the row starts in ends there)
  rows = tasks.task_examples(tasks.get_task_or_mixture('embedded_lm'), 'validation', lengths, 6)
  going_on = [r for r in rows if 1 not in r['targets'][:9].tolist()]
  assert n == len(records) == len(going_on) == len(prompted(rows, 8)) >= 4
  assert all(set(r) == {'inputs', 'targets', 'prediction', 'score', 'target_log_likelihood'}
             and r['inputs'] and r['targets'] and r['target_log_likelihood'] < 0 for r in records)
  with pytest.raises(ValueError, match='PROMPT_LENGTH 24 leaves nothing to continue'):
    infer.infer(config, checkpoint_path=str(tmp_path / 'run'), output_file=str(out),
                mixture_or_task_name='embedded_lm', task_feature_lengths=lengths, prompt_length=24)
  new = eval_cli.evaluate_checkpoints(config, checkpoint_path=str(tmp_path / 'run'),
                                      mixture_or_task_name='embedded_lm', task_feature_lengths=lengths,
                                      batch_size=4, max_batches=2, max_examples=6, prompt_length=8)
  metrics = new[2]['embedded_lm']
  assert {'log_perplexity', 'token_accuracy', 'continuation_exact_match',
          'continuation_log_perplexity'} <= set(metrics)
  # An untrained model of 4224 ids: about log(4224) = 8.35 nats per token, never an exact match.
  assert 7.5 < metrics['continuation_log_perplexity'] < 9.5 and metrics['continuation_exact_match'] == 0.0


@pytest.mark.parametrize('prefix_lm, bidirectional', [(False, True), (True, True), (True, False)])
def test_a_prefix_lm_is_prompted_with_its_inputs_eos_a_language_model_without(
    prefix_lm, bidirectional):
  """A prefix LM's training rows hold the inputs with their EOS (seqio's PrefixLMFeatureConverter);
  a language model continues the text itself, so its prompt leaves the EOS out; one trained on
  the prefix LM's rows with causal inputs (T5's 'language model') reads them with it too. A last
  batch is filled with a real prompt, not an empty one (which would start decoding at step 0)."""
  from types import SimpleNamespace  # pylint: disable=g-import-not-at-top
  from t5x_variants.train.predictor import decode_examples  # pylint: disable=g-import-not-at-top
  seen = []

  def predict(tokens, max_decode_length, batch_index):
    seen.append(tokens)
    return np.zeros((len(tokens), max_decode_length), np.int32), np.zeros(len(tokens))
  fake = SimpleNamespace(config=tiny(architecture='decoder_only', prefix_lm=prefix_lm,
                                     inputs_bidirectional_attention=bidirectional), predict=predict,
                         options=DecodeOptions())
  vocab = SimpleNamespace(decode=lambda ids: '')
  decode_examples(fake, vocab, [{'inputs': np.asarray([5, 6, EOS_ID])}], 4, 3, 2)
  row = [5, 6, EOS_ID, 0] if prefix_lm else [5, 6, 0, 0]
  np.testing.assert_array_equal(seen[0], [row, row])  # the filler row repeats a prompt
