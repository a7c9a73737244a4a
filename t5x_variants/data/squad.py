"""SQuAD v1.1 as T5's text-to-text task, and T5's fine-tuning mixture of SQuAD, GLUE and SuperGLUE.

``register_squad_tasks`` registers:
- ``squad_v010``: TFDS ``squad/v1.1:3.*.*`` (splits train, validation);
- ``squad_v010_local``: the original ``train-v1.1.json`` / ``dev-v1.1.json`` in ``squad_dir``
  (default: env SQUAD_DIR), only when given;
- mixtures ``squad_glue_super_glue_proportional`` (and ``_local``, when the SQuAD, GLUE and
  SuperGLUE local tasks are all registered): examples-proportional with T5's cap K = 2**19.
Format (Raffel et al. 2020, Appendix D; the t5 library's ``squad`` preprocessor):
'question: <question> context: <context>' -> the first answer, with every ASCII punctuation mark
spaced off in all three; metrics EM and F1 maximised over the gold answers (SQuAD normalisation).
"""
import json
import os
from typing import Iterator, List, Mapping, Optional

import seqio
import tensorflow as tf

from t5x_variants.data import glue, metrics
from t5x_variants.data import super_glue as sg

SQUAD_HINT = ('get SQuAD v1.1 (train-v1.1.json, dev-v1.1.json) from https://rajpurkar.github.io/SQuAD-explorer/ '
              'and pass squad_dir (--gin.register_tasks.squad_dir, or set SQUAD_DIR)')
MIXTURE = 'squad_glue_super_glue_proportional'
# The tasks of T5's GLUE and SuperGLUE mixtures: no WNLI, and not the test-only diagnostics (ax,
# axb, axg: rate 0 there) (glue.UNMIXED); T5's extra WSC data (DPR) is not here.
MIXTURE_GLUE_TASKS = tuple(f'glue_{t}' for t in glue.GLUE_TASKS if f'glue_{t}' not in glue.UNMIXED)
MIXTURE_SUPER_GLUE_TASKS = tuple(f'super_glue_{t}' for t in glue.SUPER_GLUE_TASKS
                                 if f'super_glue_{t}' not in glue.UNMIXED)


def _pad_punctuation(text):
  """T5's SQuAD text: a space either side of each ASCII punctuation mark, whitespace runs made one
  space (stripped at both ends, as SentencePiece would)."""
  text = tf.strings.regex_replace(text, r'([[:punct:]])', r' \1 ')
  return tf.strings.strip(tf.strings.regex_replace(text, r'\s+', ' '))


@seqio.map_over_dataset
def squad(ex):
  """'question: <question> context: <context>' -> the first answer; all answers kept for the metrics."""
  answers = _pad_punctuation(ex['answers']['text'])
  inputs = tf.strings.join(['question:', _pad_punctuation(ex['question']),
                            'context:', _pad_punctuation(ex['context'])], separator=' ')
  return {'inputs': inputs, 'targets': answers[0], 'answers': answers, 'id': ex['id']}


def read_squad(path: str, split: str) -> Iterator[dict]:
  """The original JSON (data / paragraphs / qas): one example per question, its answers in file order."""
  del split
  with open(path, encoding='utf-8') as f:
    articles = json.load(f)['data']
  for article in articles:
    for paragraph in article['paragraphs']:
      for qa in paragraph['qas']:
        yield {'id': qa['id'], 'question': qa['question'], 'context': paragraph['context'],
               'answers': {'text': [a['text'] for a in qa['answers']]}}


SQUAD = glue.TaskSpec(
    tfds_name='squad/v1.1:3.*.*', preprocessors=(squad,),
    postprocess_fn=sg.answers_postprocess,  # targets are the gold answers, predictions text
    metric_fns=(metrics.max_over_answers_em_f1,),
    signature={**{k: tf.TensorSpec([], tf.string) for k in ('id', 'question', 'context')},
               'answers': {'text': tf.TensorSpec([None], tf.string)}},
    folder='', read=read_squad, files={'train': 'train-v1.1.json', 'validation': 'dev-v1.1.json'})


def register_squad_tasks(output_features: Mapping[str, seqio.Feature], tfds_data_dir: Optional[str] = None,
                         squad_dir: Optional[str] = None, *,
                         mixing_maximum: int = glue.MIXING_MAXIMUM) -> List[str]:
  """Registers the tasks and mixtures (skipping names already registered); returns the names added.

  Call after ``glue.register_glue_tasks``: the mixtures take its tasks, and the local mixture is
  registered only when its ``*_local`` tasks are (GLUE_DIR and SUPER_GLUE_DIR given).
  """
  added = glue.add_tasks({'squad_v010': SQUAD}, output_features, tfds_data_dir,
                         squad_dir or os.environ.get('SQUAD_DIR'), SQUAD_HINT)
  tasks = ['squad_v010', *MIXTURE_GLUE_TASKS, *MIXTURE_SUPER_GLUE_TASKS]
  added += glue.add_proportional_mixture(MIXTURE, tasks, mixing_maximum)
  local = [f'{t}_local' for t in tasks]
  if set(local) <= set(seqio.TaskRegistry.names()):
    added += glue.add_proportional_mixture(f'{MIXTURE}_local', local, mixing_maximum)
  return added
