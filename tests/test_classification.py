"""Encoder-only classification / regression head (BERT's pooler on the first token): its
parameters and closed form, its loss, the GLUE classification tasks and their feature converter,
fine-tuning from an MLM checkpoint (encoder restored, head fresh), and evaluation with the tasks'
GLUE metrics (in training, and by t5xv-eval's evaluate_checkpoints)."""
import dataclasses
import functools
import json
import logging

import flax
import flax.linen as nn
import gin
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from t5x_variants.data import metrics
from t5x_variants.models import build_model, init_inputs
from t5x_variants.models import flops, losses
from t5x_variants.train import checkpoints, evaluation, partitioning, pretrained
from conftest import NO_DATA_LAYER, init_params, jit_apply, tiny, tokens
from train_helpers import save_fresh_state
from test_glue import glue_dir  # noqa: F401  (the local GLUE files fixture)

seqio = pytest.importorskip('seqio', reason=NO_DATA_LAYER)

MLM = tiny(architecture='encoder_only', num_encoder_layers=1)
CLS = dataclasses.replace(MLM, head='classification', num_labels=2)
CLS_NAMES = ('glue_cola_cls_local', 'glue_stsb_cls_local', 'glue_mnli_cls_local', 'glue_sst2_cls_local',
             'glue_ax_cls_local')


def _flat(params):
  return {'/'.join(k): np.asarray(v) for k, v in flax.traverse_util.flatten_dict(params).items()}


# --- the head -------------------------------------------------------------------------------


def test_config_validates_the_head():
  with pytest.raises(ValueError, match="valid: lm, classification"):
    tiny(architecture='encoder_only', head='pooler')
  with pytest.raises(ValueError, match="needs architecture 'encoder_only'"):
    tiny(head='classification')
  with pytest.raises(ValueError, match='num_labels must be >= 1'):
    tiny(architecture='encoder_only', head='classification', num_labels=0)


def test_head_parameters_and_pooled_logits_in_closed_form():
  """logits = W_c tanh(W_p h_0 + b_p) + b_c on the first token's final hidden state h_0,
  (batch, 1, num_labels) float32; no MLM head parameters."""
  c = dataclasses.replace(CLS, num_labels=3, use_bias=True)
  x = tokens(3, 7)
  model, params = init_params(c, x)
  shapes = {k: v.shape for k, v in _flat(params).items() if not k.startswith(('encoder/', 'token_'))}
  assert shapes == {'pooler/kernel': (32, 32), 'pooler/bias': (32,), 'classifier/kernel': (32, 3),
                    'classifier/bias': (3,)}
  _, mlm_params = init_params(MLM, x)
  assert {'mlm_transform', 'mlm_norm', 'logits_dense'} <= set(mlm_params) and 'pooler' not in mlm_params
  logits, state = jax.jit(lambda p, t: model.apply(
      {'params': p}, t, capture_intermediates=lambda m, _: m.name == 'encoder'))(params, x)
  h = np.asarray(state['intermediates']['encoder']['__call__'][0])  # (batch, length, d_model)
  assert logits.shape == (3, 1, 3) and logits.dtype == jnp.float32
  f = _flat(params)
  pooled = np.tanh(h[:, 0] @ f['pooler/kernel'] + f['pooler/bias'])
  expected = pooled @ f['classifier/kernel'] + f['classifier/bias']
  np.testing.assert_allclose(np.asarray(logits)[:, 0], expected, rtol=1e-5, atol=1e-6)
  # FLOPs: the head's two matmuls on one token per example replace the MLM head's.
  assert flops.forward_flops(c, 3, {'inputs': 7})['logits'] == 2 * 3 * 32 * (32 + 3)
  # The same config with num_labels 1: one regression output per example.
  reg_model, reg_params = init_params(dataclasses.replace(c, num_labels=1), x)
  assert jit_apply(reg_model)({'params': reg_params}, x).shape == (3, 1, 1)


def test_classification_loss_is_cross_entropy_or_squared_error():
  logits = np.array([[2.0, 0.0, -1.0], [0.5, 0.5, 0.0], [1.0, 3.0, 0.0]], np.float32)
  labels = np.array([0, 2, 1])
  weights = np.array([1.0, 1.0, 0.0])
  loss, z = losses.classification_loss(jnp.asarray(logits), jnp.asarray(labels), jnp.asarray(weights))
  log_softmax = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  np.testing.assert_allclose(loss, [-log_softmax[0, 0], -log_softmax[1, 2], 0.0], rtol=1e-6)
  np.testing.assert_array_equal(z, 0.0)
  scores = np.array([[1.5], [-0.5], [4.0]], np.float32)
  targets = np.array([3.75, 0.0, 1.0], np.float32)
  loss, z = losses.classification_loss(jnp.asarray(scores), jnp.asarray(targets), jnp.asarray(weights))
  np.testing.assert_allclose(loss, [2.25 ** 2, 0.25, 0.0], rtol=1e-6)
  np.testing.assert_array_equal(z, 0.0)


# --- tasks and the feature converter ---------------------------------------------------------


@pytest.fixture
def register(monkeypatch, glue_dir):  # noqa: F811
  """The classification tasks of ``glue_dir`` with a byte vocabulary, found by name without
  registering every other task; registrations made elsewhere are set aside and restored."""
  from t5x_variants.data import classification, tasks
  monkeypatch.setattr(tasks, 'register_tasks', lambda: [])
  saved = {n: seqio.TaskRegistry.get(n) for n in CLS_NAMES if n in seqio.TaskRegistry.names()}
  for n in saved:
    seqio.TaskRegistry.remove(n)
  added = classification.register_classification_tasks(seqio.ByteVocabulary(), glue_dir=str(glue_dir))
  yield glue_dir
  for n in added:
    seqio.TaskRegistry.remove(n)
  for n, task in saved.items():
    seqio.TaskRegistry.add_provider(n, task)


def _decode(ids):
  return seqio.ByteVocabulary().decode([int(i) for i in ids if i > 1])


def _examples(name, split='train'):
  from t5x_variants.data import pipeline
  ds = pipeline.get_dataset(name, {'inputs': 48, 'targets': 8}, 'encoder_only', split, shuffle=False,
                            num_epochs=1)
  return list(ds.as_numpy_iterator())


def test_converter_gives_tokens_labels_and_weights(register):
  from t5x_variants.data import classification, pipeline, tasks
  cola = _examples('glue_cola_cls_local')
  assert {k: (v.shape, v.dtype) for k, v in cola[0].items()} == {
      'encoder_input_tokens': ((48,), np.int32), 'classification_labels': ((), np.int32),
      'classification_weights': ((), np.int32)}
  assert [_decode(e['encoder_input_tokens']) for e in cola] == [
      'cola sentence: The cat sat.', 'cola sentence: Cat the sat.', 'cola sentence: It rains.']
  first = cola[0]['encoder_input_tokens']
  n = len('cola sentence: The cat sat.')
  assert first[n] == 1 and not first[n + 1:].any()  # EOS, then padding
  assert [(int(e['classification_labels']), int(e['classification_weights'])) for e in cola] == [
      (1, 1), (0, 1), (1, 1)]
  test = _examples('glue_cola_cls_local', 'test')  # unlabelled: weight 0
  assert [(int(e['classification_labels']), int(e['classification_weights'])) for e in test] == [(0, 0)]
  stsb = _examples('glue_stsb_cls_local')[0]  # regression: the raw score, float32
  assert stsb['classification_labels'].dtype == np.float32
  assert stsb['classification_labels'] == pytest.approx(3.75) and stsb['classification_weights'] == 1
  text = 'stsb sentence1: A plane takes off. sentence2: An air plane is taking off.'
  assert _decode(stsb['encoder_input_tokens']) == text[:47]  # cut to 48 with its EOS
  assert stsb['encoder_input_tokens'][-1] == 1
  assert int(_examples('glue_mnli_cls_local')[0]['classification_labels']) == 1  # neutral
  assert int(_examples('glue_mnli_cls_local', 'validation_mismatched')[0]['classification_labels']) == 2
  glue_dir = register  # GLUE's diagnostic set: MNLI's input, no label, MNLI's 3 classes
  (glue_dir / 'diagnostic').mkdir()
  (glue_dir / 'diagnostic/diagnostic.tsv').write_text(
      'index\tsentence1\tsentence2\n0\tA man runs.\tA person runs.\n')
  ax = _examples('glue_ax_cls_local', 'test')
  assert [(_decode(e['encoder_input_tokens']), int(e['classification_weights'])) for e in ax] == [
      ('mnli hypothesis: A person runs. premise: A man runs.'[:47], 0)]  # cut to 48 with its EOS
  assert {n: tasks.get_task_or_mixture(n).num_labels for n in CLS_NAMES} == {
      'glue_cola_cls_local': 2, 'glue_stsb_cls_local': 1, 'glue_mnli_cls_local': 3,
      'glue_sst2_cls_local': 2, 'glue_ax_cls_local': 3}
  # The last eval batch is padded with weight-0 rows.
  batch = next(pipeline.eval_batches('glue_cola_cls_local', {'inputs': 48}, 'encoder_only', 4, 'train'))
  np.testing.assert_array_equal(batch['classification_weights'], [1, 1, 1, 0])
  # A model whose head does not fit the task is one clear error.
  with pytest.raises(ValueError, match='classification task, for encoder-only models'):
    pipeline.get_dataset('glue_cola_cls_local', {'inputs': 48}, 'encoder_decoder')
  with pytest.raises(ValueError, match="give none for inputs of glue_cola_cls_local"):  # a KeyError
    pipeline.get_dataset('glue_cola_cls_local', {'input': 48}, 'encoder_only')
  with pytest.raises(ValueError, match="3-label classification task: it needs .*num_labels = 3"):
    classification.check_model(tasks.get_task_or_mixture('glue_mnli_cls_local'), CLS)
  with pytest.raises(ValueError, match="head = 'classification'.*this model: encoder_only, head 'lm'"):
    classification.check_model(tasks.get_task_or_mixture('glue_stsb_cls_local'), MLM)
  stsb = tasks.get_task_or_mixture('glue_stsb_cls_local')
  assert classification.check_model(stsb, dataclasses.replace(CLS, num_labels=1)) == 1


# --- fine-tuning from an MLM checkpoint ------------------------------------------------------


def _abstract(config):
  """The model's abstract parameters, sharded over the default mesh (what restore_params takes)."""
  mesh = partitioning.MeshConfig().mesh()
  return partitioning.sharded_abstract_params(build_model(config), init_inputs(config), mesh,
                                              partitioning.MeshConfig().rules())[1]


def _toy_batch(rows=8, length=8):
  """Rows whose label is the parity of their first token (learnable from the pooled token)."""
  x = np.asarray(tokens(rows, length, seed=3))
  return {'encoder_input_tokens': x, 'classification_labels': (x[:, 0] % 2).astype(np.int32),
          'classification_weights': np.ones(rows, np.int32)}


def test_finetuning_from_an_mlm_checkpoint(tmp_path, caplog):
  """Step 0 holds the checkpoint's encoder and embeddings and a fresh head (the MLM head is
  dropped, both logged); a few steps lower the loss, and the in-training eval reports the
  task's metrics of the head's predictions."""
  from t5x_variants.train import trainer
  from train_helpers import records_of
  mlm = save_fresh_state(MLM, tmp_path / 'mlm', seed=7)
  batch = _toy_batch()
  run = lambda steps, **kw: trainer.train(
      CLS, lambda: iter([batch] * steps), model_dir=str(tmp_path / 'ft'), total_steps=steps,
      init_checkpoint=str(tmp_path / 'mlm'), log_period=1, **kw)
  with caplog.at_level(logging.INFO, logger='t5x_variants'):
    run(0, eval_period=0)
  assert ('initialised fresh: classifier/kernel, pooler/kernel; not used (dropped): logits_dense/kernel, '
          'mlm_norm/scale, mlm_transform/kernel') in caplog.text
  abstract = _abstract(CLS)
  step0 = _flat(pretrained.restore_params(str(tmp_path / 'ft' / 'checkpoint_0'), abstract))
  fresh = _flat(nn.unbox(build_model(CLS).init(jax.random.PRNGKey(0), *init_inputs(CLS))['params']))
  mlm_params = _flat(mlm)
  assert set(step0) == set(fresh) and not any(k.startswith('mlm') for k in step0)
  for k, v in step0.items():
    if k.startswith(('pooler', 'classifier')):
      np.testing.assert_allclose(v, fresh[k], rtol=1e-6, atol=1e-7, err_msg=k)  # a seed-0 init
    else:
      np.testing.assert_array_equal(v, mlm_params[k], err_msg=k)
      if k.endswith(('kernel', 'embedding')):  # the checkpoint's, not a fresh initialisation
        assert not np.array_equal(v, fresh[k]), k
  # Resumed from checkpoint_0: ten steps on the toy batch, then an eval with the task's metrics.
  run(10, eval_data=lambda: {'toy': [batch]}, eval_period=10,
      eval_metric_fns={'toy': (metrics.f1, metrics.accuracy)})
  losses_ = [r['loss'] for r in records_of(tmp_path / 'ft')]
  assert len(losses_) == 10 and losses_[-1] < 0.5 * losses_[0], losses_
  (ev,) = records_of(tmp_path / 'ft', 'eval')
  assert {'loss', 'log_perplexity', 'token_accuracy', 'accuracy', 'f1', 'num_tokens'} <= set(ev) and ev['num_tokens'] == 8
  assert 0.0 <= ev['accuracy'] <= 100.0 and ev['accuracy'] > 50.0  # percent, from the predictions
  assert ev['token_accuracy'] == pytest.approx(ev['accuracy'] / 100)  # a fraction, of the same rows


def test_a_new_head_with_the_checkpoints_optimizer_state_is_refused_by_name(tmp_path):
  """init_optimizer restores every statistic; a fresh head has none saved: one error that says
  to start the optimizer afresh (before: 'holds another model', as for a wrong checkpoint)."""
  from t5x_variants.train import trainer
  save_fresh_state(MLM, tmp_path / 'mlm', seed=7)
  with pytest.raises(checkpoints.CheckpointError,
                     match=r'no optimizer state for .*new parameters \(classifier/kernel, pooler/kernel\).*'
                           r'init_optimizer=False'):
    trainer.train(CLS, lambda: iter([_toy_batch()]), model_dir=str(tmp_path / 'ft'),
                  total_steps=1, init_checkpoint=str(tmp_path / 'mlm'), init_optimizer=True)
  assert not (tmp_path / 'ft' / 'checkpoint_0').exists()


def test_a_checkpoint_of_another_model_is_refused(tmp_path):
  """Only the head may be missing: an encoder of another shape is a CheckpointError."""
  save_fresh_state(dataclasses.replace(MLM, d_ff=48), tmp_path, seed=0)
  abstract = _abstract(CLS)
  with pytest.raises(checkpoints.CheckpointError, match='another model .*encoder/.*saved .*48'):
    pretrained.restore_params(str(tmp_path), abstract, fresh=('pooler', 'classifier'))
  with pytest.raises(checkpoints.CheckpointError, match='another model .*classifier/kernel'):
    pretrained.restore_params(str(tmp_path), abstract)  # nothing may be fresh: Predictor.load


# --- evaluation with GLUE metrics ------------------------------------------------------------


def _eval(config, params, batches, metric_fns):
  mesh = partitioning.MeshConfig().mesh()
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  step = evaluation.make_eval_step(build_model(config), config,
                                   jax.tree_util.tree_map(lambda _: sharding, params), mesh)
  return evaluation.evaluate(step, params, batches, mesh, metric_fns=metric_fns)


def test_eval_metrics_of_a_constructed_classifier():
  """A zero classifier predicts class 0 with logits (0, 0): loss log 2 per labelled example; of
  labels (1, 0, 0, 1, 1) it gets 2 right (accuracy 40%) and no true positive (F1 0). Padding rows
  (weight 0, label 1) count nowhere."""
  x = np.asarray(tokens(8, 6))
  _, params = init_params(CLS, x)
  params = dict(params, classifier={'kernel': jnp.zeros_like(params['classifier']['kernel'])})
  labels = np.array([1, 0, 0, 1, 1, 1, 1, 1], np.int32)
  weights = np.array([1, 1, 1, 1, 1, 0, 0, 0], np.int32)
  batches = [{'encoder_input_tokens': x[i:i + 4], 'classification_labels': labels[i:i + 4],
              'classification_weights': weights[i:i + 4]} for i in (0, 4)]
  out = _eval(CLS, params, batches, (metrics.f1, metrics.accuracy, metrics.matthews_corrcoef))
  assert out == pytest.approx({'loss': np.log(2), 'log_perplexity': np.log(2), 'accuracy': 40.0,
                               'token_accuracy': 0.4, 'f1': 0.0, 'matthews_corrcoef': 0.0, 'num_tokens': 5.0})


def test_eval_metrics_of_a_regression_head():
  """num_labels 1: 'loss' is the mean squared error and Pearson / Spearman are those of the head's
  outputs; no accuracy or log-perplexity."""
  config = dataclasses.replace(CLS, num_labels=1)
  x = np.asarray(tokens(6, 6, seed=1))
  model, params = init_params(config, x)
  scores = np.array([0.0, 1.2, 2.4, 3.8, 5.0, 9.9], np.float32)
  weights = np.array([1, 1, 1, 1, 1, 0], np.int32)
  predicted = np.asarray(jit_apply(model)({'params': params}, x))[:5, 0, 0]
  out = _eval(config, params, [{'encoder_input_tokens': x, 'classification_labels': scores,
                                'classification_weights': weights}],
              (metrics.pearson_corrcoef, metrics.spearman_corrcoef))
  expected = {'loss': float(np.mean((predicted - scores[:5]) ** 2)), 'num_tokens': 5.0,
              **metrics.pearson_corrcoef(scores[:5], predicted),
              **metrics.spearman_corrcoef(scores[:5], predicted)}
  assert out == pytest.approx(expected, rel=1e-4)


def test_t5xv_eval_of_whole_examples_evaluates_each_at_the_longest_length(register, tmp_path, capsys):
  """EVAL_FEATURE_LENGTHS=None (T5X's eval.gin): every example whole, the task at its split's longest
  example; the same figures as that length given, or a longer one (padding changes nothing),
  where the run's shorter length cuts the inputs and changes them. The settings record None."""
  from t5x_variants.cli import eval as eval_cli
  sentences = ['a gorgeous film', 'dull and lifeless to the very end', 'warm']
  (register / 'SST-2' / 'dev.tsv').write_text(
      '\n'.join(['sentence\tlabel'] + [f'{s}\t{i % 2}' for i, s in enumerate(sentences)]) + '\n')
  config = dataclasses.replace(CLS, vocab_size=seqio.ByteVocabulary().vocab_size)
  longest = len('sst2 sentence: ') + max(map(len, sentences)) + 1  # bytes and EOS

  def evaluate(run, lengths):
    save_fresh_state(config, tmp_path / run, seed=2, step=3)
    return eval_cli.evaluate_checkpoints(config, checkpoint_path=str(tmp_path / run),
                                         mixture_or_task_name='glue_sst2_cls_local',
                                         task_feature_lengths=lengths, batch_size=2)[3]['glue_sst2_cls_local']
  whole = evaluate('whole', None)
  assert (f'glue_sst2_cls_local (validation): whole examples, the longest inputs {longest} tokens'
          in capsys.readouterr().out)
  assert whole == pytest.approx(evaluate('given', {'inputs': longest}), rel=1e-6)
  assert whole == pytest.approx(evaluate('longer', {'inputs': longest + 9}), rel=1e-5)
  assert whole['loss'] != evaluate('cut', {'inputs': 8})['loss']
  saved = json.loads((tmp_path / 'whole' / 'eval_results.json').read_text())['validation']
  assert saved['settings']['glue_sst2_cls_local']['task_feature_lengths'] is None
  # A model whose parameters are sized by its rows' length (a synthesizer's) cannot read longer
  # ones: one error before any checkpoint is read (the synthesizer's own said to resize it).
  sized = dataclasses.replace(config, self_attention='random', encoder_max_length=longest - 1)
  with pytest.raises(ValueError, match=(
      f'the longest validation example of glue_sst2_cls_local makes encoder rows of {longest} '
      fr'tokens, more than this model reads \(encoder_max_length {longest - 1}: .*EVAL_FEATURE_LENGTHS')):
    eval_cli.evaluate_checkpoints(sized, checkpoint_path=str(tmp_path / 'whole'),
                                  mixture_or_task_name='glue_sst2_cls_local', task_feature_lengths=None)


def test_whole_examples_are_measured_over_the_examples_read(register, tmp_path, capsys):
  """With max_batches (and max_examples for the passes that decode or score) whole examples are
  measured over the first examples those read, not the split: here the longest comes third and
  one batch of two reads it not, so the task is evaluated at the second-longest length, with the
  figures of that length given."""
  from t5x_variants.cli import eval as eval_cli
  sentences = ['a gorgeous film', 'warm', 'dull and lifeless to the very end']
  (register / 'SST-2' / 'dev.tsv').write_text(
      '\n'.join(['sentence\tlabel'] + [f'{s}\t{i % 2}' for i, s in enumerate(sentences)]) + '\n')
  config = dataclasses.replace(CLS, vocab_size=seqio.ByteVocabulary().vocab_size)
  read = len('sst2 sentence: a gorgeous film') + 1  # bytes and EOS

  def evaluate(run, lengths):
    save_fresh_state(config, tmp_path / run, seed=2, step=3)
    return eval_cli.evaluate_checkpoints(
        config, checkpoint_path=str(tmp_path / run), mixture_or_task_name='glue_sst2_cls_local',
        task_feature_lengths=lengths, batch_size=2, max_batches=1)[3]['glue_sst2_cls_local']
  whole = evaluate('whole', None)
  assert (f'glue_sst2_cls_local (validation): whole examples, the longest of its first 2 inputs '
          f'{read} tokens' in capsys.readouterr().out)
  assert whole == pytest.approx(evaluate('given', {'inputs': read}), rel=1e-6)
  # The passes beside the teacher-forced one read max_examples (scores one more); all: None.
  assert eval_cli.examples_read((), 2, 3, None) == 6
  assert eval_cli.examples_read(('predict',), 2, 1, 9) == 10
  assert eval_cli.examples_read(('scores',), 8, 2, 9) == 16
  assert eval_cli.examples_read(('predict',), 2, 1, None) is None
  assert eval_cli.examples_read((), 2, None, 5) is None


def test_t5xv_eval_reports_the_glue_metrics_of_a_classifier(register, tmp_path):
  """evaluate_checkpoints on a classification task: eval_results.json {split: {step: {task: metrics}}}
  with the loss and the task's accuracy of the checkpoint's predicted labels."""
  from t5x_variants.cli import eval as eval_cli
  from t5x_variants.data import pipeline
  sst2 = ['sentence\tlabel', 'a gorgeous film\t1', 'dull and lifeless\t0', 'warm and funny\t1',
          'painfully slow\t0', 'a triumph\t1']
  (register / 'SST-2' / 'dev.tsv').write_text('\n'.join(sst2) + '\n')
  config = dataclasses.replace(CLS, vocab_size=seqio.ByteVocabulary().vocab_size)
  params = save_fresh_state(config, tmp_path / 'run', seed=2, step=3)
  lengths = {'inputs': 32, 'targets': 4}
  new = eval_cli.evaluate_checkpoints(config, checkpoint_path=str(tmp_path / 'run'),
                                      mixture_or_task_name='glue_sst2_cls_local',
                                      task_feature_lengths=lengths, batch_size=4)
  results = json.loads((tmp_path / 'run' / 'eval_results.json').read_text())['validation']
  assert new == {3: results['3']} and set(results['3']) == {'glue_sst2_cls_local'}
  got = results['3']['glue_sst2_cls_local']
  batches = list(pipeline.eval_batches('glue_sst2_cls_local', lengths, 'encoder_only', 4))
  x = np.concatenate([b['encoder_input_tokens'] for b in batches])[:5]
  logits = np.asarray(jit_apply(build_model(config))({'params': params}, jnp.asarray(x)))[:, 0]
  expected = metrics.accuracy([1, 0, 1, 0, 1], logits.argmax(-1))['accuracy']
  assert got['accuracy'] == pytest.approx(expected) and got['num_tokens'] == 5
  log_softmax = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  assert got['loss'] == pytest.approx(-np.mean(log_softmax[range(5), [1, 0, 1, 0, 1]]), rel=1e-5)
  # The skip is keyed by split: the same checkpoint again on validation is skipped, on train it is
  # evaluated (its file has one example less), and both splits stay in the file.
  (register / 'SST-2' / 'train.tsv').write_text('\n'.join(sst2[:-1]) + '\n')
  evaluate = functools.partial(eval_cli.evaluate_checkpoints, config, checkpoint_path=str(tmp_path / 'run'),
                               mixture_or_task_name='glue_sst2_cls_local',
                               task_feature_lengths=lengths, batch_size=4)
  assert evaluate() == {}
  on_train = evaluate(split='train')
  assert on_train[3]['glue_sst2_cls_local']['num_tokens'] == 4
  saved = json.loads((tmp_path / 'run' / 'eval_results.json').read_text())
  assert saved['train']['3'] == on_train[3] and saved['validation']['3'] == results['3']
  assert set(saved['train']['best']['glue_sst2_cls_local']['loss']) == {'value', 'step'}
  assert 'num_decodes' not in json.dumps(saved)  # at its default: the settings of older files match
  # Other settings for a task already evaluated: one error, the file unchanged (a skip would mix
  # them); another batch size changes nothing where every batch is read.
  with pytest.raises(ValueError, match=r"results of glue_sst2_cls_local made with other settings "
                                       r"\(max_batches: None there, 1 now; batch_size"):
    evaluate(max_batches=1)
  assert json.loads((tmp_path / 'run' / 'eval_results.json').read_text()) == saved
  # A decoding option out of range is said as such, not as other settings than the file's.
  gin.bind_parameter('DecodeOptions.method', 'beam_search')
  try:
    with pytest.raises(ValueError, match="DecodeOptions.method = 'beam_search' is out of range"):
      evaluate()
  finally:
    gin.clear_config()
  assert evaluate(batch_size=2) == {}
