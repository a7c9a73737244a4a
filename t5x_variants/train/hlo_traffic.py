"""Where a compiled step's memory traffic goes: the bytes each instruction of the optimized HLO
(``compiled.as_text()``) reads and writes, its output plus its operands, for every instruction
outside a fusion (a fusion counts once, as a whole; an asynchronous start/done pair once; a loop
body once, as the compiler's cost model counts it), grouped by kind and by the model op it came
from (its ``op_name``, layer numbers folded, backward ops marked). Our arithmetic on the
program's shapes, not the compiler's cost model: that one also weighs where each buffer lives,
so the totals differ.
"""
import collections
import re
from typing import Dict, List, NamedTuple

_ITEM_BYTES = {'pred': 1, 's8': 1, 'u8': 1, 's16': 2, 'u16': 2, 'f16': 2, 'bf16': 2, 's32': 4,
               'u32': 4, 'f32': 4, 's64': 8, 'u64': 8, 'f64': 8}
_ARRAY = re.compile(r'\b(' + '|'.join(_ITEM_BYTES) + r')\[([0-9,]*)\]')
_HEADER = re.compile(r'^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$')
_INSTRUCTION = re.compile(r'^\s*(?:ROOT )?%(\S+) = (.*?) ([a-z][a-z0-9-]*)\((.*)$')
# No traffic of their own: names for other buffers and control flow. An asynchronous pair (X-start,
# X-done: a copy, a slice, a collective, or 'async-start' around a called computation) counts once,
# at its done: the array the done returns, written, and what the start reads (for a slice, the
# part it reads: as much as it writes); the start's tuple holds the operand and the destination
# again and is not counted, nor is an 'async-update' between them.
_FREE = {'parameter', 'get-tuple-element', 'tuple', 'constant', 'bitcast', 'after-all',
         'partition-id', 'replica-id', 'while', 'call', 'conditional', 'async-update'}
_COLLECTIVES = ('all-gather', 'all-reduce', 'reduce-scatter', 'collective-permute', 'all-to-all')
MATMULS = {'dot', 'convolution'}


class Instruction(NamedTuple):
  name: str
  kind: str  # matmul, kernel, collective, async copy, copy, reduction, other
  source: str
  bytes: int


def array_bytes(shape: str) -> int:
  """Bytes of every array in an HLO shape (a tuple's elements summed), layouts ignored."""
  total = 0
  for dtype, dims in _ARRAY.findall(shape):
    n = 1
    for d in filter(None, dims.split(',')):
      n *= int(d)
    total += n * _ITEM_BYTES[dtype]
  return total


def computations(text: str) -> Dict[str, List[tuple]]:
  """{computation: [(name, shape, opcode, the rest after 'opcode(', line)]} of an HLO module's
  text; a computation's header may name it with or without '%' (XLA's printers differ)."""
  found, current = {}, None
  for line in text.splitlines():
    if (header := _HEADER.match(line)):
      current = found.setdefault(header.group(1), [])
    elif current is not None and (m := _INSTRUCTION.match(line)):
      current.append((m.group(1), m.group(2), m.group(3), m.group(4), line))
  return found


_CALLERS = ('fusion', 'async-start')  # run the computation they call, counted as one instruction


def opcodes(program: Dict[str, List[tuple]], opcode: str, line: str) -> set:
  """The opcodes an instruction runs: a fusion's or an 'async-start''s, those of the computation
  it calls (and of the fusions in it)."""
  callee = re.search(r'calls=%?([\w.\-]+)', line) if opcode in _CALLERS else None
  if not callee:
    return {opcode}
  return set().union(*[opcodes(program, op, inner) for _, _, op, _, inner in
                       program.get(callee.group(1), [])])


def _start_of(name: str, body: Dict[str, tuple]):
  """The '-start' instruction (opcode, rest, line) that a '-done''s operand ``name`` comes from,
  through tuple elements and 'async-update's; None if there is none in ``body``."""
  while name in body:
    op, rest, _ = body[name]
    if op.endswith('-start'):
      return body[name]
    if op not in ('get-tuple-element', 'async-update', 'bitcast'):
      return None
    name = (_operands(rest) or [None])[0]
  return None


def source(op_name: str) -> str:
  """'backward: encoder/layers_*/mlp/wi/dot_general' from a traced op's name."""
  backward = 'transpose(' in op_name
  path = re.sub(r'layers_\d+', 'layers_*', op_name)
  path = re.sub(r'jit\([^()]*\)/?', '', path)  # the jitted function's (or a jnp helper's) name
  path = re.sub(r'\b(?:jvp|transpose|vmap|remat|checkpoint)\(', '', path).replace(')', '')
  parts = [p for p in path.split('/') if p not in ('', 'while', 'body', 'closed_call', 'shard_map')]
  # 'EncoderDecoder/EncoderDecoder.encode/...' (a module, then its method): the method says both
  parts = [p for p, after in zip(parts, parts[1:] + ['']) if not after.startswith(p + '.')]
  return ('backward: ' if backward else '') + '/'.join(parts)


def _operands(rest: str) -> List[str]:
  """The operand names of an instruction, from the text after its 'opcode('."""
  return re.findall(r'%([\w.\-]+)', rest.split(')')[0])


def instructions(text: str) -> List[Instruction]:
  """Every instruction with traffic, outside fusions and reducers."""
  program = computations(text)
  inner = {callee for body in program.values() for _, _, op, _, line in body
           for key, callee in re.findall(r'(calls|to_apply)=%?([\w.\-]+)', line)
           if op in _CALLERS or key == 'to_apply'}
  found = []
  for name, body in program.items():
    if name in inner:
      continue
    shapes = {n: shape for n, shape, _, _, _ in body}
    by_name = {n: (op, rest, line) for n, _, op, rest, line in body}
    for n, shape, op, rest, line in body:
      if op in _FREE or op.endswith('-start'):
        continue
      written = array_bytes(shape)
      if op.endswith('-done'):  # its start's reads, or (none found) its writes alone
        op, rest, line = (_start_of((_operands(rest) or [''])[0], by_name)
                          or (op[:-len('done')] + 'start', '', line))
      read = (written if op == 'slice-start' else
              sum(array_bytes(shapes.get(o, '')) for o in _operands(rest)))
      words = opcodes(program, op, line)
      if words & MATMULS:
        kind = 'matmul'
      elif op != 'fusion' and 'custom-call' in words:  # a custom call, or one started asynchronously
        kind = 'kernel'
      elif any(w.startswith(_COLLECTIVES) for w in words):
        kind = 'collective'
      elif op in ('copy-start', 'slice-start'):
        kind = 'async copy'
      elif op in ('copy', 'transpose'):
        kind = 'copy'
      elif 'reduce' in words:
        kind = 'reduction'
      else:
        kind = 'other'
      moved = written + read
      op_name = re.search(r'op_name="([^"]*)"', line)
      found.append(Instruction(n, kind, source(op_name.group(1)) if op_name else '', moved))
  return found


def summary(text: str, top: int = 25) -> Dict:
  """{'total_bytes', 'by_kind': {kind: bytes}, 'by_source': [[kind, source, count, bytes]] (the
  ``top`` largest)}."""
  found = instructions(text)
  by_kind = collections.Counter()
  by_source, counts = collections.Counter(), collections.Counter()
  for i in found:
    by_kind[i.kind] += i.bytes
    by_source[(i.kind, i.source)] += i.bytes
    counts[(i.kind, i.source)] += 1
  return {'total_bytes': sum(by_kind.values()), 'by_kind': dict(by_kind.most_common()),
          'by_source': [[k, s, counts[(k, s)], b] for (k, s), b in by_source.most_common(top)]}


def table(traffic: Dict) -> str:
  """The summary as lines to print."""
  gb = lambda n: f'{n / 1e9:8.2f} GB'
  lines = [f'memory traffic per device (our count from the compiled HLO, not the cost model): '
           f'{traffic["total_bytes"] / 1e9:.2f} GB']
  lines += [f'  {gb(b)}  {k}' for k, b in traffic['by_kind'].items()]
  lines.append('  largest sources (kind, count, op):')
  unnamed = "(no op name: the compiler's own)"
  lines += [f'  {gb(b)}  {k:<10} {c:5d}  {s or unnamed}' for k, s, c, b in traffic['by_source']]
  return '\n'.join(lines)
