"""What a run directory says about its run: ``metrics.jsonl`` (train, eval and diagnostics
records), ``config.gin`` (total steps) and ``model-info.txt`` (parameter count)."""
import dataclasses
import math
import re
from typing import Dict, List, Optional

from t5x_variants.train import storage
from t5x_variants.train.metrics import read_records

# A run counts as diverged at the first logged step whose training loss was not finite (or whose
# update was skipped as non-finite), or, if its last logged loss is more than this many nats above
# the lowest logged before it (a blow-up that did not end in NaN and did not recover, as Post-LN's
# divergence often does), at the first step that was.
BLOW_UP_NATS = 1.0


@dataclasses.dataclass
class RunRecord:
  model_dir: str
  train: List[dict]
  evals: Dict[str, List[dict]]  # task -> eval records by step
  diagnostics: List[dict]
  total_steps: Optional[int]
  params: Optional[int]
  # It evaluates as it trains (not t5xv-eval's evals): config.gin binds train.eval_period > 0 and an
  # eval task, so the eval of its last step is due, or it logged its own evals after step 0.
  evaluates: bool = False
  on_nonfinite: str = 'skip'  # train.on_nonfinite: 'stop' ends the run at a non-finite step

  @property
  def step(self) -> int:
    return max([r['step'] for r in self.train] or [0])

  @property
  def task(self) -> Optional[str]:
    """The evaluated task (the first, if several; one the run evaluates itself before one only
    t5xv-eval did)."""
    return next(iter(self.evals), None)

  def eval_metric(self, task: Optional[str] = None) -> str:
    """What ``eval_curve`` holds: 'log_perplexity' where the evals record it, else 'loss' (a
    classification head's cross-entropy per example, a regression head's squared error)."""
    records = self.evals.get(task or self.task, [])
    return 'log_perplexity' if any('log_perplexity' in r for r in records) else 'loss'

  def eval_curve(self, task: Optional[str] = None) -> List[tuple]:
    """(step, held-out log-perplexity, or loss for tasks without one) of every eval; nan where
    it was not finite (written as null)."""
    metric = self.eval_metric(task)
    return [(r['step'], math.nan if r[metric] is None else r[metric])
            for r in self.evals.get(task or self.task, []) if metric in r]

  def final_eval(self) -> Optional[float]:
    """The eval of the run's last step (``total_steps``, where known); None where there is none,
    as in a run stopped between its last checkpoint and that eval (a rerun redoes the eval)."""
    curve = self.eval_curve()
    return curve[-1][1] if curve and curve[-1][0] >= (self.total_steps or self.step) else None

  def best_eval(self) -> Optional[float]:
    values = [v for _, v in self.eval_curve() if math.isfinite(v)]
    return min(values) if values else None

  def tokens_per_second(self) -> Optional[float]:
    """Mean over the logged windows but each trainer session's first (which holds its
    compilation); a session is its records' ``start_step`` (records written without one: the
    first window overall left out)."""
    sessions, values = set(), []
    for r in self.train:
      if r.get('start_step') not in sessions:
        sessions.add(r.get('start_step'))
      elif r.get('tokens_per_second'):
        values.append(r['tokens_per_second'])
    return sum(values) / len(values) if values else None

  def trained(self) -> bool:
    """Trained to ``total_steps``."""
    return self.total_steps is not None and self.step >= self.total_steps

  def finished(self) -> bool:
    """Trained to ``total_steps`` and, if it evaluates as it trains, evaluated that step."""
    return self.trained() and (not self.evaluates or self.final_eval() is not None)

  def stopped_non_finite(self) -> bool:
    """Whether the trainer stopped it at a non-finite step: its last record's loss is not finite
    (every step of the window skipped), or it skipped one there under ``on_nonfinite='stop'``."""
    last = self.train[-1] if self.train else {}
    return bool(last) and (last.get('loss') is None or not math.isfinite(last['loss'])
                           or (self.on_nonfinite == 'stop' and bool(last.get('skipped'))))

  def diverged_at(self) -> Optional[int]:
    """The first step of a divergence of its training loss (``BLOW_UP_NATS``) or of a non-finite
    held-out value, whichever came first; None if neither."""
    lowest, blown_up = math.inf, None
    for r in self.train:
      loss = r.get('loss')
      if loss is None or not math.isfinite(loss) or r.get('skipped'):
        blown_up = r['step']
        break
      blown_up = (blown_up or r['step']) if loss > lowest + BLOW_UP_NATS else None  # or recovered
      lowest = min(lowest, loss)
    nonfinite = next((s for s, v in self.eval_curve() if not math.isfinite(v)), None)
    return min((s for s in (blown_up, nonfinite) if s is not None), default=None)


def _read(model_dir: str, name: str) -> str:
  """The text of a run directory's file (local or on an object store); '' if there is none."""
  path = storage.path(model_dir) / name
  return path.read_text() if path.exists() else ''


def _bound(config: str, key: str) -> Optional[str]:
  """The value a run's config.gin (gin's operative configuration) binds ``key`` to, as written, a
  macro (``%NAME``) resolved; None if it binds none."""
  found = re.search(rf'^{re.escape(key)} = (.+)$', config, re.M)
  value = found.group(1).strip() if found else None
  return _bound(config, value[1:]) if value and value.startswith('%') else value


def _last_by_step(records: List[dict]) -> List[dict]:
  """One record per step (a resumed run logs some steps again: the latest wins), by step."""
  return sorted({r['step']: r for r in records}.values(), key=lambda r: r['step'])


def _evals_by_step(records: List[dict]) -> List[dict]:
  """One eval record per step: the training run's own (the latest where a resumed run logged the
  step again) with the metrics that only ``t5xv-eval``'s validation records of that step add
  (scores of decoded text, unless the run decoded them itself: ``train.infer_eval``); where both
  have a metric, the run's own stands (over the batches and examples it read). A step only
  ``t5xv-eval`` evaluated (often the last checkpoint) has its record alone: over the whole split,
  where the run's own evals may read a few batches."""
  own = {r['step']: r for r in records if 'split' not in r}
  added = {r['step']: r for r in records if 'split' in r}
  return [{**added.get(s, {}), **own.get(s, {})} for s in sorted(own.keys() | added.keys())]


def read_run(model_dir: str) -> RunRecord:
  records = read_records(model_dir)
  evals = {}
  for r in records:
    if r.get('kind') == 'eval' and r.get('split', 'validation') == 'validation':
      evals.setdefault(r['task'], []).append(r)
  text = _read(model_dir, 'config.gin')
  steps = _bound(text, 'train.total_steps') or _bound(text, 'TRAIN_STEPS')
  total_steps = int(steps) if steps and steps.isdigit() else None
  on_nonfinite = (_bound(text, 'train.on_nonfinite') or "'skip'").strip('\'"')
  found = re.search(r'Total number of parameters: ([\d,]+)', _read(model_dir, 'model-info.txt'))
  params = int(found.group(1).replace(',', '')) if found else None
  # (gin's operative configuration, as the trainer writes it, names every value it used: the
  # default period too, and a task bound unscoped under the scope it was read in)
  period = _bound(text, 'train.eval_period') or ''
  eval_task = _bound(text, 'train_eval/DatasetConfig.mixture_or_task_name')
  scheduled = period.isdigit() and int(period) > 0 and eval_task not in (None, 'None', "''", '""')
  evaluates = scheduled or any('split' not in r and r['step'] > 0 for v in evals.values() for r in v)
  # the tasks the run evaluates itself first (``task``), then those only t5xv-eval did
  evals = dict(sorted(evals.items(), key=lambda item: all('split' in r for r in item[1])))
  return RunRecord(model_dir, _last_by_step([r for r in records if r.get('kind') == 'train']),
                   {t: _evals_by_step(v) for t, v in evals.items()},
                   _last_by_step([r for r in records if r.get('kind') == 'diagnostics']),
                   total_steps, params, evaluates, on_nonfinite)
