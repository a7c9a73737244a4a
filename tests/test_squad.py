"""SQuAD v1.1: T5's text format from TFDS (mocked) and the original JSON, EM/F1, the mixture with GLUE."""
import json
import re

import pytest

from conftest import NO_DATA_LAYER

seqio = pytest.importorskip('seqio', reason=NO_DATA_LAYER)
tfds = pytest.importorskip('tensorflow_datasets', reason=NO_DATA_LAYER)

from t5x_variants.data import glue, metrics, squad, tasks  # noqa: E402

VOCAB = seqio.ByteVocabulary()
FEATURES = {k: seqio.Feature(VOCAB) for k in ('inputs', 'targets')}
REGISTRIES = (seqio.TaskRegistry, seqio.MixtureRegistry)
CONTEXTS = ('The Eiffel Tower, built in 1889, is in Paris.',
            "The Normans' duchy  was Normandy (France), ruled by William I.")
LOCAL_MIXTURE = 'squad_glue_super_glue_proportional_local'


@pytest.fixture
def registry(monkeypatch):
  """No GLUE/SuperGLUE/SQuAD names registered and no *_DIR from the environment; afterwards the
  registries are as they were (names registered by other tests are set aside meanwhile)."""
  for var in ('GLUE_DIR', 'SUPER_GLUE_DIR', 'SQUAD_DIR'):
    monkeypatch.delenv(var, raising=False)
  ours = ('glue_', 'super_glue_', 'squad_')
  saved = [(r, n, r.get(n)) for r in REGISTRIES for n in r.names() if n.startswith(ours)]
  for r, n, _ in saved:
    r.remove(n)
  before = {r: set(r.names()) for r in REGISTRIES}
  yield
  for r in REGISTRIES:
    for n in set(r.names()) - before[r]:
      r.remove(n)
  for r, n, provider in saved:
    r.add_provider(n, provider)


def _qa(qid, question, context, *answers):
  return {'id': qid, 'question': question,
          'answers': [{'text': a, 'answer_start': context.index(a)} for a in answers]}


@pytest.fixture
def squad_dir(tmp_path):
  """train-v1.1.json: 2 articles, 4 questions; q2 and q4 have several answers. No dev file."""
  eiffel, normans = CONTEXTS
  data = {'version': '1.1', 'data': [
      {'title': 'Eiffel_Tower', 'paragraphs': [{'context': eiffel, 'qas': [
          _qa('q1', 'Where is the Eiffel Tower?', eiffel, 'Paris'),
          _qa('q2', 'When was it built?', eiffel, '1889', '1889', 'in 1889')]}]},
      {'title': 'Normans', 'paragraphs': [{'context': normans, 'qas': [
          _qa('q3', "Which country's region is Normandy?", normans, 'France'),
          _qa('q4', 'Who ruled the duchy?', normans, 'William I.', 'William')]}]}]}
  root = tmp_path / 'squad'
  root.mkdir()
  (root / 'train-v1.1.json').write_text(json.dumps(data))
  return root


@pytest.fixture
def glue_dirs(tmp_path):
  """CoLA's train (3 rows) and BoolQ's train (1 row) in GLUE_DIR / SUPER_GLUE_DIR layouts."""
  cola = tmp_path / 'glue/CoLA/train.tsv'
  cola.parent.mkdir(parents=True)
  cola.write_text(''.join(f'gj04\t1\t\tIt rains {i}.\n' for i in range(3)))
  boolq = tmp_path / 'super_glue/BoolQ/train.jsonl'
  boolq.parent.mkdir(parents=True)
  boolq.write_text(json.dumps({'question': 'is it', 'passage': 'It is.', 'idx': 0, 'label': True}) + '\n')
  return str(cola.parents[1]), str(boolq.parents[1])


def _register(**squad_kwargs):
  return glue.register_glue_tasks(FEATURES) + squad.register_squad_tasks(FEATURES, **squad_kwargs)


def _examples(name, split='train'):
  ds = seqio.get_mixture_or_task(name).get_dataset(None, split=split, shuffle=False, try_in_mem_cache=False)
  return list(ds.as_numpy_iterator())


def _text(ex, key):
  return ex[key + '_pretokenized'].decode()


def test_local_task_t5_format(registry, squad_dir):
  assert 'squad_v010_local' in _register(squad_dir=str(squad_dir))
  examples = _examples('squad_v010_local')
  eiffel = 'context: The Eiffel Tower , built in 1889 , is in Paris .'
  normans = "context: The Normans ' duchy was Normandy ( France ) , ruled by William I ."
  assert [(_text(e, 'inputs'), _text(e, 'targets')) for e in examples] == [
      (f'question: Where is the Eiffel Tower ? {eiffel}', 'Paris'),
      (f'question: When was it built ? {eiffel}', '1889'),
      (f"question: Which country ' s region is Normandy ? {normans}", 'France'),
      (f'question: Who ruled the duchy ? {normans}', 'William I .')]
  assert [e['id'].decode() for e in examples] == ['q1', 'q2', 'q3', 'q4']
  assert [a.decode() for a in examples[1]['answers']] == ['1889', '1889', 'in 1889']
  assert VOCAB.decode(examples[3]['targets'].tolist()) == 'William I .'
  task = seqio.get_mixture_or_task('squad_v010_local')
  gold = [task.postprocess_fn(_text(e, 'targets'), example=e, is_target=True) for e in examples]
  assert gold[3] == ['William I .', 'William']
  predictions = ['Paris', 'built in 1889', 'Normandy', 'William I .']
  # EM: q1 and q4. F1: 1, 0.8 ('built in 1889' vs 'in 1889': P 2/3, R 1), 0, 1.
  assert task.metric_fns[0](gold, predictions) == pytest.approx({'em': 50.0, 'f1': 100 * 2.8 / 4})


def test_tfds_task_loads_with_mock_data(registry):
  _register()
  with tfds.testing.mock_data(num_examples=3):
    examples = _examples('squad_v010', 'validation')
  assert len(examples) == 3
  for ex in examples:
    assert re.fullmatch(r'question: .* context: .*', _text(ex, 'inputs'))
    assert _text(ex, 'targets') == ex['answers'][0].decode() == VOCAB.decode(ex['targets'].tolist())


def test_em_f1_max_over_answers():
  # 'the Eiffel tower' normalises to 'eiffel tower': EM 1, F1 1.
  # 'in Paris, France' -> 'in paris france' vs 'paris': P 1/3, R 1 -> F1 1/2; vs 'city of paris': 1/3.
  # 'Normandy' vs 'France': 0.
  scores = metrics.max_over_answers_em_f1(
      [['Eiffel Tower', 'tower'], ['Paris', 'the city of Paris'], ['France']],
      ['the Eiffel tower', 'in Paris, France', 'Normandy'])
  assert scores == pytest.approx({'em': 100 / 3, 'f1': 100 * 1.5 / 3})
  assert metrics.normalize_answer('The  U.S.!') == 'us'


def test_missing_file_names_it(registry, squad_dir):
  _register(squad_dir=str(squad_dir))
  with pytest.raises(FileNotFoundError, match=re.escape(str(squad_dir / 'dev-v1.1.json')) + '.*SQuAD-explorer'):
    _examples('squad_v010_local', 'validation')


def test_mixtures(registry, squad_dir, glue_dirs):
  glue_dir, super_glue_dir = glue_dirs
  expected = {'squad_v010', *(f'glue_{t}' for t in ('cola', 'sst2', 'mrpc', 'qqp', 'stsb', 'mnli',
                                                    'mnli_mismatched', 'qnli', 'rte')),
              *(f'super_glue_{t}' for t in ('boolq', 'cb', 'copa', 'multirc', 'record', 'rte', 'wic', 'wsc'))}
  names = _register(squad_dir=str(squad_dir))  # no local GLUE/SuperGLUE: no local mixture
  assert 'squad_glue_super_glue_proportional' in names
  assert LOCAL_MIXTURE not in seqio.MixtureRegistry.names()
  assert {t.name for t in seqio.get_mixture_or_task('squad_glue_super_glue_proportional').tasks} == expected
  glue.register_glue_tasks(FEATURES, glue_dir=glue_dir, super_glue_dir=super_glue_dir)
  assert squad.register_squad_tasks(FEATURES, squad_dir=str(squad_dir)) == [LOCAL_MIXTURE]
  assert {t.name for t in seqio.get_mixture_or_task(LOCAL_MIXTURE).tasks} == {f'{t}_local' for t in expected}

  def rates():  # of the fixture's SQuAD (4 questions), CoLA (3 rows) and BoolQ (1 row) train files
    mixture = seqio.get_mixture_or_task(LOCAL_MIXTURE)
    names = ('squad_v010_local', 'glue_cola_local', 'super_glue_boolq_local', 'glue_mnli_mismatched_local')
    return [mixture.get_rate(seqio.get_mixture_or_task(n)) for n in names]
  assert rates() == [4.0, 3.0, 1.0, 0.0]  # under the cap K = 2**19; MNLI mismatched: evaluated only
  seqio.MixtureRegistry.remove(LOCAL_MIXTURE)
  assert squad.register_squad_tasks(FEATURES, mixing_maximum=2) == [LOCAL_MIXTURE]
  assert rates() == [2.0, 2.0, 1.0, 0.0]


def test_register_tasks_with_the_embedded_vocabulary(registry, squad_dir):
  names = tasks.register_tasks(squad_dir=str(squad_dir))
  assert {'squad_v010', 'squad_v010_local', 'squad_glue_super_glue_proportional'} <= set(names)
  task = seqio.get_mixture_or_task('squad_v010_local')
  ex = tasks.task_examples(task, 'train', {'inputs': 512, 'targets': 32}, max_examples=1)[0]
  vocabulary = task.output_features['targets'].vocabulary
  assert vocabulary.decode(ex['targets'].tolist()) == 'Paris'
  assert vocabulary.decode(ex['inputs'].tolist()) == _text(ex, 'inputs')
