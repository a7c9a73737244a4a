"""SuperGLUE specifics: JSONL readers, and the ReCoRD, MultiRC and WSC text formats (T5's).

The readers turn the original distribution files (``<dir>/<Task>/{train,val,test}.jsonl``) into
the raw features TFDS's ``super_glue`` yields, so one preprocessor serves both sources. Tasks are
registered by ``glue.register_glue_tasks``.
"""
import json
from typing import Iterator, Sequence

import seqio
import tensorflow as tf

from t5x_variants.data import tasks

NO_LABEL = '<unk>'
_BOOL_NAMES = ('False', 'True')
# The words T5's WSC scoring (its postprocessor wsc_simple) ignores in a noun phrase.
_DETERMINERS = frozenset('a an each every few her his many much my our some that the their these '
                         'this those which whose your'.split())
# Two texts whose pronoun T5 marks by hand (its _wsc_inputs): in the first the pronoun's word
# carries punctuation; in the second the dataset's index points at the word before the pronoun.
_WSC_MARKED = {
    'The boy continued to whip the pony , and eventually the pony threw him over. John laughed '
    'out quite loud. "Good for him," he said. ':
        'The boy continued to whip the pony , and eventually the pony threw him over. John laughed '
        'out quite loud. "Good for *him* ," he said.',
    'When they had eventually calmed down a bit , and had gotten home, Mr. Farley put the magic '
    'pebble in an iron safe . Some day they might want to use it , but really for now, what more '
    'could they wish for?':
        'When they had eventually calmed down a bit , and had gotten home, Mr. Farley put the magic '
        'pebble in an iron safe . Some day they might want to use *it* , but really for now, what '
        'more could they wish for?',
}


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


def wsc_fixed(row: dict) -> dict:
  """TFDS's ``super_glue/wsc.fixed`` (the WSC T5 trains on) from an original row: a span whose
  text is not in the text takes the case of the text's word at its index and loses a trailing '.'
  and its newlines; the two spans with words between theirs stay as they are."""
  row = dict(row)
  for span in ('span1', 'span2'):
    text, index = row[f'{span}_text'], row[f'{span}_index']
    if text in row['text'] or text in ('Kamenev and Zinoviev', 'Kamenev, Zinoviev, and Stalin'):
      continue
    if 'theyscold' in text:  # as TFDS: span2's index becomes 10, the text keeps 'theyscold'
      row['span2_index'] = 10
    first = row['text'].split()[index]
    text = (text[0].lower() if first[0].islower() else text[0].upper()) + text[1:]
    row[f'{span}_text'] = text.rstrip('.').replace('\n', ' ')
  return row


def flat_reader(fields: Sequence[str], label_names: Sequence[str] = _BOOL_NAMES):
  """Reader for tasks with one example per line; WSC's span fields (under ``target``) as
  ``wsc_fixed`` gives them."""
  def read(path, split):
    del split
    for row in _jsonl(path):
      if 'target' in row:
        row = wsc_fixed({**row, **row['target']})
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
  """Removes the HTML of the paragraph, the question and the answer (T5 cleans the joined input):
  ``<br>`` becomes a space, ``<b>`` tags go."""
  clean = lambda text: tf.strings.regex_replace(tf.strings.regex_replace(text, '<br>', ' '), '</?b>', '')
  return {**ex, **{k: clean(ex[k]) for k in ('paragraph', 'question', 'answer')}}


def record(ds):
  """'record query: <query> entities: <e1>, <e2> passage: <passage>' -> one example per gold
  answer, as T5 trains (a query without answers, as in the test split, gives one, target
  ``<unk>``); each keeps the query's answers and idx, so the metric scores every query once
  (``metrics.record_em_f1``)."""
  def examples(ex):
    passage = tf.strings.regex_replace(ex['passage'], r'([.!?"\'])\n@highlight\n', r'\1 ')
    passage = tf.strings.regex_replace(passage, r'\n@highlight\n', '. ')
    inputs = tf.strings.join(['record query:', ex['query'], 'entities:',
                              tf.strings.reduce_join(ex['entities'], separator=', '), 'passage:',
                              passage], separator=' ')
    targets = tf.concat([ex['answers'], [NO_LABEL]], 0)[:record_examples(ex)]
    repeat = lambda x: tf.repeat(x[tf.newaxis], tf.size(targets), axis=0)
    return tf.data.Dataset.from_tensor_slices({
        'inputs': repeat(inputs), 'targets': targets, 'answers': repeat(ex['answers']),
        'idx': {k: repeat(v) for k, v in ex['idx'].items()}})
  return ds.flat_map(examples)


def record_examples(ex):
  """The examples ``record`` makes of a ReCoRD row."""
  return tf.maximum(tf.size(ex['answers']), 1)


def _mark_pronoun(text, index, pronoun):
  """Wraps the words of ``pronoun`` starting at word ``index`` of ``text`` (its words separated by
  single spaces, as the dataset counts them) in asterisks, trailing punctuation outside; the texts
  of ``_WSC_MARKED`` as T5 marks them."""
  words = tf.strings.split(text, sep=' ')
  n = tf.size(words)
  start = tf.clip_by_value(index, 0, n)
  stop = tf.minimum(start + tf.size(tf.strings.split(pronoun)), n)
  span = tf.strings.reduce_join(words[start:stop], separator=' ')
  span = tf.strings.regex_replace(span, r'^(.*?)(\W*)$', r'*\1*\2')
  marked = tf.strings.reduce_join(tf.concat([words[:start], [span], words[stop:]], 0), separator=' ')
  for original, by_hand in _WSC_MARKED.items():
    marked = tf.where(tf.equal(text, original), by_hand, marked)
  return marked


@seqio.map_over_dataset
def wsc(ex):
  """T5's simplified WSC: 'wsc: <text with the *pronoun* marked>' -> the candidate referent."""
  inputs = tf.strings.join(['wsc:', _mark_pronoun(ex['text'], ex['span2_index'], ex['span2_text'])],
                           separator=' ')
  return {'inputs': inputs, 'targets': ex['span1_text'], 'idx': ex['idx'], 'label': ex['label']}


def wsc_correct_referent(ex):
  """Train-split examples of a WSC row: 1 if its candidate is the referent, else 0 (a wrong
  candidate would teach the wrong answer)."""
  return tf.cast(ex['label'] == 1, tf.int32)


def multirc_postprocess(output: str, example=None, is_target: bool = False) -> dict:
  """'True'/'False' -> {'group': (paragraph, question), 'value': 1/0, or -1 if unrecognised}."""
  del is_target
  idx = example['idx']
  return {'group': (int(idx['paragraph']), int(idx['question'])),
          'value': _BOOL_NAMES.index(output) if output in _BOOL_NAMES else -1}


def answers_postprocess(output: str, example=None, is_target: bool = False):
  """Targets become the list of gold answers (SQuAD's); predictions stay strings."""
  return [tasks.text(a) for a in example['answers']] if is_target else output


def record_postprocess(output: str, example=None, is_target: bool = False):
  """Targets become {'group': (passage, query), 'value': the gold answers}; predictions stay
  strings."""
  if not is_target:
    return output
  idx = example['idx']
  return {'group': (int(idx['passage']), int(idx['query'])),
          'value': answers_postprocess(output, example, is_target)}


def _without_determiners(text: str) -> str:
  return ' '.join(w for w in text.strip().lower().split(' ') if w not in _DETERMINERS)


def wsc_postprocess(output: str, example=None, is_target: bool = False) -> int:
  """Targets: the example's label. Predictions, as T5's wsc_simple scores them: 1 if the
  predicted noun phrase names the candidate (lower-cased, split at spaces, punctuation kept,
  determiners dropped: one's words contain the other's, and both or neither has an apostrophe:
  'Bob' does not name "Bob's hat"), else 0; -1, never a label, if nothing is left of the
  prediction (an empty answer must not match label 0)."""
  if is_target:
    return int(example['label'])
  predicted = _without_determiners(output)
  if not predicted:
    return -1
  candidate = _without_determiners(tasks.text(example['targets_pretokenized']))
  if ("'" in predicted) != ("'" in candidate):
    return 0
  predicted, candidate = set(predicted.split(' ')), set(candidate.split(' '))
  return int(predicted <= candidate or candidate <= predicted)
