"""A sweep: base gin files x variant gin files (one or more axes) x grid values of gin bindings
(one axis per ``--grid``) x seeds, each run in its own run directory under one sweep directory,
recorded in ``SWEEP_DIR/sweep.json``.

A run is named by its variant files' stems, its grid values (``NAME=VALUE``: the binding's last
dotted component and the value, filesystem-safe) and its seed (``swiglu-seed0``,
``post_ln+depth_18-seed1``, ``pre_ln+base=3e-4-seed0``) and trained by ``t5xv-train`` in
``SWEEP_DIR/<name>``. Seed ``s`` sets ``train.seed`` (initialization, dropout) and
``train/DatasetConfig.seed`` (data order). A sweep binds ``train.on_nonfinite = 'stop'``: a
diverging run stops at its first non-finite step and is recorded as diverged there (a binding
given to the sweep overrides it).

Statuses in sweep.json: ``pending``, ``running`` (or killed), ``interrupted`` (Ctrl-C or SIGTERM:
passed on to the trainer, which saves a checkpoint once it is training), ``done``, ``diverged``
(non-finite loss, with its step) and ``failed`` (with the error line). Running a sweep again skips
done and diverged runs (and runs whose directory reached the last step, e.g. trained from
``--print_commands``), resumes interrupted ones from their last checkpoint (the trainer does) and
retries failed ones (runner.py runs them); runs trained elsewhere are read back from their
directories (``update_from_run_dirs``). Runs recorded by an earlier, larger grid stay in
sweep.json (and in the report) without being scheduled. A gin file edited since the sweep's runs
were made with it is refused (``digests``: the files named, not those they include). One sweep
process at a time holds a sweep directory.
"""
import ast
import dataclasses
import glob
import hashlib
import itertools
import json
import os
import re
import shlex
from typing import Dict, List, Optional, Sequence, Tuple

from t5x_variants import PACKAGE_DIR
from t5x_variants.sweeps import runs as run_records
from t5x_variants.train import storage

SWEEP_FILE = 'sweep.json'
FINISHED = ('done', 'diverged')
DEFAULT_BINDINGS = ("train.on_nonfinite = 'stop'",)
# Set per run by the sweep itself: a --grid over them would contradict the run's name or seed.
PER_RUN_KEYS = ('MODEL_DIR', 'train.seed', 'train/DatasetConfig.seed')


class SweepError(ValueError):
  """A sweep that cannot be built or does not match the sweep directory's."""


def locate(pattern: str, search_paths: Sequence[str] = ()) -> List[str]:
  """The gin files a path or glob names, looked up as ``t5xv-train`` looks them up: from the
  working directory, then each search path, then the installed package (which ships ``gin/``);
  absolute, so the runs' commands read the same files from any working directory."""
  for root in ['', *search_paths, PACKAGE_DIR]:
    path = os.path.join(root, pattern)
    found = [os.path.abspath(m) for m in (sorted(glob.glob(path)) if glob.has_magic(pattern)
                                          else [path]) if os.path.isfile(m)]
    if found:
      return found
  return []


def expand(pattern: str, search_paths: Sequence[str] = ()) -> List[str]:
  """The gin files of one ``--variants`` value: comma-separated files or globs, in order."""
  files = []
  for part in filter(None, (p.strip() for p in pattern.split(','))):
    matches = locate(part, search_paths)
    if not matches:
      raise SweepError(f'--variants {part!r} matches no gin file (looked in the working directory, '
                       '--gin_search_paths and the installed package)')
    files += matches
  return files


def stem(path: str) -> str:
  return os.path.splitext(os.path.basename(path))[0]


def binding_parts(binding: str) -> Tuple[str, str]:
  """(``KEY``, ``VALUE``) of a binding ``KEY = VALUE``."""
  key, _, value = binding.partition('=')
  return key.strip(), value.strip()


def grid_label(value: str) -> str:
  """A grid value as it appears in a run's name: gin quotes, ``@`` and ``%`` dropped, any other
  character outside ``[A-Za-z0-9._-]`` (``/``, ``+``, spaces, ...) turned into ``_``."""
  return re.sub(r'[^A-Za-z0-9._-]+', '_', value.strip().strip('\'"').lstrip('@%')).strip('_')


def parse_grid(flag: str) -> List[Tuple[str, str]]:
  """The choices of one ``--grid=BINDING=V1,V2,...`` axis: (name part ``NAME=VALUE``, binding
  ``BINDING = VALUE``) per value, where NAME is BINDING's last dotted (or scoped) component:
  ``learning_rate_schedule.base=1e-4,3e-4`` gives ``base=1e-4`` and ``base=3e-4``."""
  key, sep, values = flag.partition('=')
  key = key.strip()
  if key.startswith('--gin.'):
    key = key[len('--gin.'):]
  values = [v.strip() for v in values.split(',') if v.strip()]
  if not sep or not re.fullmatch(r'[A-Za-z_][\w./]*', key) or not values:
    raise SweepError(f'--grid {flag!r}: expected --grid=BINDING=VALUE1,VALUE2,... '
                     '(e.g. learning_rate_schedule.base=1e-4,3e-4)')
  if key in PER_RUN_KEYS:
    raise SweepError(f'--grid {key}: the sweep sets it for every run itself')
  spaced = [v for v in values if len(v.split()) > 1 and not _is_literal(v)
            and all(map(_is_literal, v.split()))]
  if spaced:  # gin would call it an unquoted string
    raise SweepError(f'--grid {flag!r}: {spaced[0]!r} looks like several values; a --grid\'s values '
                     f'are separated by commas: --grid={key}={",".join(spaced[0].split())}')
  name = re.split(r'[./]', key)[-1]
  labels = [grid_label(v) for v in values]
  literals = [_literal(v) for v in values]
  same = [(a, b) for i, a in enumerate(values) for j, b in enumerate(values)
          if i < j and literals[i] == literals[j]]
  if same:
    raise SweepError(f'--grid {flag!r}: {same[0][0]} and {same[0][1]} are one value (two runs of '
                     'one configuration): give it once')
  if not all(labels) or len(set(labels)) != len(labels):
    raise SweepError(f'--grid {flag!r}: its values must name distinct runs '
                     f'(as {", ".join(repr(f"{name}={l}") for l in labels)})')
  return [(f'{name}={label}', f'{key} = {value}') for label, value in zip(labels, values)]


@dataclasses.dataclass
class Run:
  name: str
  variant: str  # the variant files' stems and grid values (NAME=VALUE) joined by '+'
  variant_files: List[str]
  seed: int
  status: str = 'pending'
  reason: Optional[str] = None
  diverged_step: Optional[int] = None
  seconds: Optional[float] = None
  bindings: List[str] = dataclasses.field(default_factory=list)  # the grid's, KEY = VALUE


@dataclasses.dataclass
class Sweep:
  sweep_dir: str
  base: List[str]
  axes: List[List[str]]
  seeds: int
  bindings: List[str]
  paper: Optional[str] = None
  grid: List[str] = dataclasses.field(default_factory=list)  # the --grid flags, BINDING=V1,V2
  runs: List[Run] = dataclasses.field(default_factory=list)
  batches_dir: Optional[str] = None  # every run reads pre-built batches from there
  kept: List[Run] = dataclasses.field(default_factory=list)  # recorded earlier, not in this grid
  search_paths: List[str] = dataclasses.field(default_factory=list)  # --gin_search_paths, passed on
  # sha256 of each gin file the runs were made with, by real path: an edited file is refused
  digests: Dict[str, str] = dataclasses.field(default_factory=dict)

  @classmethod
  def build(cls, sweep_dir: str, base: Sequence[str], variant_patterns: Sequence[str], seeds: int,
            bindings: Sequence[str] = (), paper: Optional[str] = None,
            grid: Sequence[str] = (), search_paths: Sequence[str] = ()) -> 'Sweep':
    """The grid, seed-major (every variant's seed 0 first), so a partial sweep compares them all:
    the product of the ``--variants`` axes (gin files) and then the ``--grid`` axes (values of one
    binding each), in the order given."""
    if seeds < 1:
      raise SweepError(f'--seeds must be at least 1, got {seeds}')
    search_paths = [os.path.abspath(p) for p in search_paths if p]
    found = [locate(f, search_paths) for f in base]
    missing = [f for f, paths in zip(base, found) if len(paths) != 1]
    if missing:
      raise SweepError(f'base gin file not found: {", ".join(missing)} (looked in the working '
                       'directory, --gin_search_paths and the installed package)')
    base = [paths[0] for paths in found]
    axes = [expand(p, search_paths) for p in variant_patterns]
    grid_axes = [parse_grid(g) for g in grid]
    keys = [binding_parts(axis[0][1])[0] for axis in grid_axes]
    names = [axis[0][0].split('=')[0] for axis in grid_axes]
    given = {binding_parts(b)[0] for b in bindings}
    if given & set(PER_RUN_KEYS):
      raise SweepError(f'--gin.{sorted(given & set(PER_RUN_KEYS))[0]}: the sweep sets it for every '
                       'run itself (its directory, its seed); leave it out')
    if len(set(keys)) != len(keys) or len(set(names)) != len(names) or given & set(keys):
      raise SweepError('each --grid needs its own binding, not also given as --gin, and its own '
                       f'last name component (got {", ".join(keys)})')
    sweep = cls(_absolute(sweep_dir), base, axes, seeds, list(bindings), paper, list(grid),
                search_paths=search_paths,
                digests={os.path.realpath(f): _digest(f) for f in [*base, *sum(axes, [])]})
    choices = [[(stem(f), [f], []) for f in files] for files in axes]
    choices += [[(label, [], [binding]) for label, binding in axis] for axis in grid_axes]
    combos = list(itertools.product(*choices))
    for seed in range(seeds):
      for combo in combos:
        variant = '+'.join(label for label, _, _ in combo) or 'base'
        files = [f for _, fs, _ in combo for f in fs]
        grid_bindings = [b for _, _, bs in combo for b in bs]
        sweep.runs.append(Run(f'{variant}-seed{seed}', variant, files, seed,
                              bindings=grid_bindings))
    names = [r.name for r in sweep.runs]
    if len(set(names)) != len(names):
      raise SweepError('two variant files have the same name; give them distinct file names')
    return sweep

  def model_dir(self, run: Run) -> str:
    return storage.join(self.sweep_dir, run.name)

  def command(self, run: Run, executable: Sequence[str] = ('t5xv-train',)) -> List[str]:
    """The ``t5xv-train`` command line of ``run``: its gin files, then its bindings (the run's
    directory and seed, its grid values, the sweep's own), and the sweep's ``--batches_dir``."""
    bindings = [*DEFAULT_BINDINGS, f"MODEL_DIR = '{self.model_dir(run)}'",
                f'train.seed = {run.seed}', f'train/DatasetConfig.seed = {run.seed}',
                *run.bindings, *self.bindings]
    return [*executable, *[f'--gin_file={f}' for f in [*self.base, *run.variant_files]],
            *([f'--gin_search_paths={",".join(self.search_paths)}'] if self.search_paths else []),
            *[f'--gin.{k}={v}' for k, v in map(binding_parts, bindings)],
            *([f'--batches_dir={self.batches_dir}'] if self.batches_dir else [])]

  # --- sweep.json --------------------------------------------------------------------------------

  def all_runs(self) -> List[Run]:
    return self.runs + self.kept

  def to_json(self) -> dict:
    d = dataclasses.asdict(self)
    d['runs'] = [dataclasses.asdict(r) for r in self.all_runs()]
    del d['kept']
    for r, run in zip(d['runs'], self.all_runs()):
      r['model_dir'] = self.model_dir(run)
      r['command'] = shell_line(self.command(run))
    return d

  def save(self):
    """sweep.json, replaced whole: a reader never sees half a file."""
    storage.write_text(storage.join(self.sweep_dir, SWEEP_FILE),
                       json.dumps(self.to_json(), indent=1))

  @classmethod
  def load(cls, sweep_dir: str) -> 'Sweep':
    path = storage.path(storage.join(sweep_dir, SWEEP_FILE))
    if not path.exists():
      raise FileNotFoundError(f'{path} not found: not a sweep directory (t5xv-sweep writes it)')
    fields = {f.name for f in dataclasses.fields(Run)}
    try:
      d = json.loads(path.read_text())
      runs = [Run(**{k: v for k, v in r.items() if k in fields}) for r in d.pop('runs')]
      d['sweep_dir'] = _absolute(sweep_dir)  # where it is now, if it was moved
      return cls(**d, runs=runs)
    except (ValueError, TypeError, KeyError, AttributeError) as e:  # not JSON, or not a sweep's
      raise SweepError(f'{path} cannot be read as a sweep record ({type(e).__name__}: {e}): restore '
                       'it (the run directories beside it are intact) or use another --sweep_dir') from None

  def merge_previous(self):
    """Keeps the record of runs this sweep directory already has; refuses a different base,
    other bindings, and a gin file whose content changed since."""
    if not storage.path(storage.join(self.sweep_dir, SWEEP_FILE)).exists():
      return
    old = Sweep.load(self.sweep_dir)
    if (len(old.base) != len(self.base) or not all(map(_same_file, old.base, self.base))
        or _effective(old.bindings) != _effective(self.bindings)):
      raise SweepError(f'{self.sweep_dir} holds a sweep of other base gin files or bindings '
                       f'({" ".join(old.base + old.bindings)}); use another --sweep_dir')
    previous = {r.name: r for r in old.runs}
    recorded = {_configuration(r): r.name for r in old.runs}
    for run in self.runs:  # a name holds only stems and a binding's last name component
      named = recorded.get(_configuration(run), run.name)
      if run.name not in previous and named != run.name:  # (a value respelled: 1e-3 after 0.001)
        raise SweepError(f'{self.sweep_dir} recorded {run.name}\'s configuration as {named} (a '
                         'grid value written another way): write the values as its runs were '
                         'named, or use another --sweep_dir')
      was = previous.get(run.name)
      if was and (was.bindings != run.bindings or len(was.variant_files) != len(run.variant_files)
                  or not all(map(_same_file, was.variant_files, run.variant_files))):
        raise SweepError(f'{self.sweep_dir} recorded {run.name} with other variant files or grid '
                         f'bindings ({" ".join(was.variant_files + was.bindings)}, now '
                         f'{" ".join(run.variant_files + run.bindings)}); use another --sweep_dir')
    edited = [f for f, d in self.digests.items() if old.digests.get(f, d) != d]
    if edited:
      raise SweepError(f'{edited[0]} has changed since {self.sweep_dir}\'s runs were made with it '
                       '(its runs and new ones would be two configurations in one table): restore '
                       'it, or use another --sweep_dir')
    self.digests = {**old.digests, **self.digests}
    self.runs = [previous.get(r.name, r) for r in self.runs]
    names = {r.name for r in self.runs}
    self.kept = [r for r in old.runs if r.name not in names]
    self.paper = self.paper or old.paper

  def update_from_run_dirs(self):
    """What the run directories say of runs trained elsewhere (``--print_commands``) or changed
    since: an unfinished run whose directory reached its last step is done, one its trainer
    stopped at a non-finite step diverged there (at its last step too); a done one whose
    directory lacks the eval of its last step (recorded done before that counted), or whose
    metrics no longer reach that step (cut), is interrupted: a rerun redoes what is missing. A
    directory that cannot be read (no config.gin: deleted, or a store's read failing) changes
    nothing."""
    for run in self.all_runs():
      if run.status == 'diverged':
        continue
      record = run_records.read_run(self.model_dir(run))
      if (run.status != 'done' and record.stopped_non_finite()  # (a stopped run logs no last eval)
          and not (record.evaluates and record.finished())):
        at = record.diverged_at()
        run.status, run.diverged_step = 'diverged', record.step if at is None else at
        run.reason = 'stopped at a non-finite step (read from its directory)'
      elif run.status != 'done' and record.finished():
        run.status, run.reason = 'done', None
      elif run.status == 'done' and record.total_steps is not None and not record.finished():
        # (only where its config.gin was read: an unreadable directory is no evidence)
        run.status, run.reason = 'interrupted', (
            'no eval of its last step (a rerun redoes it)' if record.trained() else
            'its metrics no longer reach its last step (a rerun trains it from there)')


def _is_literal(value: str) -> bool:
  try:
    ast.literal_eval(value)
  except Exception:  # pylint: disable=broad-except  (any failure: not a Python literal)
    return False
  return True


def _literal(value: str):
  """A grid value as gin reads it where it is a Python literal, a number by its value (``1e-3``
  and ``0.001``, ``1000`` and ``1e3`` are one value: two runs of one configuration), else as
  written."""
  try:
    parsed = ast.literal_eval(value)
  except Exception:  # pylint: disable=broad-except  (not a literal, or an unhashable one's parts)
    return value
  if isinstance(parsed, (int, float)) and not isinstance(parsed, bool):
    return 'number', float(parsed)
  return type(parsed).__name__, repr(parsed)


def _effective(bindings: Sequence[str]) -> Dict[str, str]:
  """What ``bindings`` bind, the later of two of one key winning (as gin applies them): the same
  whatever the order of distinct keys (which changed when --gin. flags stopped going last)."""
  return dict(map(binding_parts, bindings))


def _configuration(run: Run) -> tuple:
  """What a run trains: its variant files, its grid values as gin reads them, its seed."""
  values = tuple((k, _literal(v)) for k, v in map(binding_parts, run.bindings))
  return tuple(map(os.path.realpath, run.variant_files)), values, run.seed


def _digest(path: str) -> str:
  with open(path, 'rb') as f:
    return hashlib.sha256(f.read()).hexdigest()


def _same_file(a: str, b: str) -> bool:
  return a == b or os.path.realpath(a) == os.path.realpath(b)


def shell_line(command: Sequence[str]) -> str:
  """``command`` for a shell, with gin string values written as ``--gin.KEY="'value'"``."""
  def quote(arg):
    key, sep, value = arg.partition('=')
    if sep and shlex.quote(arg) != arg and not set('"$`\\!') & set(arg):
      return f'{key}="{value}"' if shlex.quote(key) == key else shlex.quote(arg)
    return shlex.quote(arg)
  return ' '.join(quote(a) for a in command)


def _absolute(sweep_dir: str) -> str:
  return sweep_dir if storage.scheme(sweep_dir) else os.path.abspath(sweep_dir)
