"""SuperGLUE specifics: JSONL readers, and the ReCoRD, MultiRC and WSC text formats (T5's).

The readers turn the original distribution files (``<dir>/<Task>/{train,val,test}.jsonl``) into
the raw features TFDS's ``super_glue`` yields, so one preprocessor serves both sources. Tasks are
registered by ``glue.register_glue_tasks``.
"""
import json
import re
from typing import Iterator, Sequence

import seqio
import tensorflow as tf

from t5x_variants.data import tasks

NO_LABEL = '<unk>'
_BOOL_NAMES = ('False', 'True')
_DETERMINERS = frozenset('a an the this that these those his her its their my our your some'.split())


def _jsonl(path: str) -> Iterator[dict]:
  with open(path, encoding='utf-8') as f:
    for line in f:
      if line.strip():
        yield json.loads(line)


def _label_id(label, label_names: Sequence[str]) -> int:
  """JSON label -> class id: names by position, bools and ints as they are; none (test) -> -1."""
  if label is None:
    return -1
  return label_names.index(label) if isinstance(label, str) else int(label)


def flat_reader(fields: Sequence[str], label_names: Sequence[str] = _BOOL_NAMES):
  """Reader for tasks with one example per line; WSC's span fields are under ``target``."""
  def read(path, split):
    del split
    for row in _jsonl(path):
      row = {**row, **row.get('target', {})}
      yield {**{k: row[k] for k in fields}, 'idx': row['idx'],
             'label': _label_id(row.get('label'), label_names)}
  return read


def read_multirc(path: str, split: str) -> Iterator[dict]:
  """One example per answer option of each question about a paragraph."""
  del split
  for row in _jsonl(path):
    passage = row['passage']
    for question in passage['questions']:
      for answer in question['answers']:
        yield {'paragraph': passage['text'], 'question': question['question'], 'answer': answer['text'],
               'label': _label_id(answer.get('label'), _BOOL_NAMES),
               'idx': {'paragraph': row['idx'], 'question': question['idx'], 'answer': answer['idx']}}


def read_record(path: str, split: str) -> Iterator[dict]:
  """One example per query; entity spans are inclusive character offsets into the passage."""
  del split
  for row in _jsonl(path):
    text = row['passage']['text']
    entities = sorted({text[e['start']:e['end'] + 1] for e in row['passage']['entities']})
    for qa in row['qas']:
      yield {'passage': text, 'query': qa['query'], 'entities': entities,
             'answers': sorted({a['text'] for a in qa.get('answers', [])}),
             'idx': {'passage': row['idx'], 'query': qa['idx']}}


@seqio.map_over_dataset
def multirc_markup(ex):
  """Removes the paragraph's HTML: ``<br>`` becomes a space, ``<b>`` tags go."""
  paragraph = tf.strings.regex_replace(ex['paragraph'], '<br>', ' ')
  return {**ex, 'paragraph': tf.strings.regex_replace(paragraph, '</?b>', '')}


@seqio.map_over_dataset
def record(ex):
  """'record query: <query> entities: <e1>, <e2> passage: <passage>' -> the first gold answer."""
  passage = tf.strings.regex_replace(ex['passage'], r'([.!?"\'])\n@highlight\n', r'\1 ')
  passage = tf.strings.regex_replace(passage, r'\n@highlight\n', '. ')
  inputs = tf.strings.join(['record query:', ex['query'], 'entities:',
                            tf.strings.reduce_join(ex['entities'], separator=', '), 'passage:', passage],
                           separator=' ')
  targets = tf.concat([ex['answers'], [NO_LABEL]], 0)[0]
  return {'inputs': inputs, 'targets': targets, 'answers': ex['answers'], 'idx': ex['idx']}


def _mark_pronoun(text, index, pronoun):
  """Wraps the words of ``pronoun`` starting at word ``index`` of ``text`` in asterisks (trailing
  punctuation stays outside)."""
  words = tf.strings.split(text)
  n = tf.size(words)
  start = tf.clip_by_value(index, 0, n)
  stop = tf.minimum(start + tf.size(tf.strings.split(pronoun)), n)
  span = tf.strings.reduce_join(words[start:stop], separator=' ')
  span = tf.strings.regex_replace(span, r'^(.*?)(\W*)$', r'*\1*\2')
  return tf.strings.reduce_join(tf.concat([words[:start], [span], words[stop:]], 0), separator=' ')


@seqio.map_over_dataset
def wsc(ex):
  """T5's simplified WSC: 'wsc: <text with the *pronoun* marked>' -> the candidate referent."""
  inputs = tf.strings.join(['wsc:', _mark_pronoun(ex['text'], ex['span2_index'], ex['span2_text'])],
                           separator=' ')
  return {'inputs': inputs, 'targets': ex['span1_text'], 'idx': ex['idx'], 'label': ex['label']}


def wsc_correct_referent(ex):
  """Train-split filter: only examples whose candidate is the referent teach the right answer.
  Works on python dicts (counting) and on tf.data elements."""
  return ex['label'] == 1


def multirc_postprocess(output: str, example=None, is_target: bool = False) -> dict:
  """'True'/'False' -> {'group': (paragraph, question), 'value': 1/0, or -1 if unrecognised}."""
  del is_target
  idx = example['idx']
  return {'group': (int(idx['paragraph']), int(idx['question'])),
          'value': _BOOL_NAMES.index(output) if output in _BOOL_NAMES else -1}


def record_postprocess(output: str, example=None, is_target: bool = False):
  """Targets become the list of gold answers; predictions stay strings."""
  return [tasks.text(a) for a in example['answers']] if is_target else output


def _content_words(text: str) -> set:
  return {w for w in re.findall(r"[\w']+", text.lower()) if w not in _DETERMINERS}


def wsc_postprocess(output: str, example=None, is_target: bool = False) -> int:
  """Targets: the example's label. Predictions: 1 if the predicted noun phrase matches the
  candidate (one's content words contain the other's), else 0; -1, never a label, if the
  prediction has no content word (as T5's wsc_simple: an empty answer must not match label 0)."""
  if is_target:
    return int(example['label'])
  predicted = _content_words(output)
  if not predicted:
    return -1
  candidate = _content_words(tasks.text(example['targets_pretokenized']))
  return int(bool(candidate) and (predicted <= candidate or candidate <= predicted))
