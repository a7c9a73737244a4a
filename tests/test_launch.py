"""The console scripts re-execute themselves once with glibc's transparent-huge-page tunable."""
import os
import subprocess
import sys

import pytest

from t5x_variants import launch


def test_reexec_is_skipped_when_set_or_turned_off():
  assert not launch.wants_reexec({'GLIBC_TUNABLES': f'glibc.malloc.arena_max=2:{launch.TUNABLE}'})
  assert not launch.wants_reexec({'T5XV_HUGEPAGES': '0'})


@pytest.mark.skipif(not launch.wants_reexec({}), reason='no glibc or no transparent huge pages here')
def test_reexec_runs_the_same_command_once_with_the_tunable():
  code = ('import os; from t5x_variants import launch; print("start", os.getpid(), flush=True); '
          'launch.reexec_with_hugepages(); print("tunables", os.getpid(), os.environ["GLIBC_TUNABLES"])')
  env = {k: v for k, v in os.environ.items() if k not in ('GLIBC_TUNABLES', 'T5XV_HUGEPAGES')}
  env['GLIBC_TUNABLES'] = 'glibc.malloc.arena_max=4'
  out = subprocess.run([sys.executable, '-c', code], env=env, capture_output=True, text=True, check=True)
  lines = out.stdout.split()
  assert lines.count('start') == 2 and lines.count('tunables') == 1, out.stdout
  starts = [lines[i + 1] for i, w in enumerate(lines) if w == 'start']
  assert starts[0] == starts[1] == lines[lines.index('tunables') + 1]  # same process, replaced
  assert lines[-1] == f'glibc.malloc.arena_max=4:{launch.TUNABLE}'


def test_console_script_runs_through_the_launcher():
  script = os.path.join(os.path.dirname(sys.executable), 't5xv-bench')
  if not os.path.exists(script):
    pytest.skip('package not installed as console scripts')
  out = subprocess.run([script, '--help'], capture_output=True, text=True, check=True)
  assert 't5xv-bench' in out.stdout
