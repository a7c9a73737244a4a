"""Memory traffic read from a compiled program (train/hlo_traffic.py): bytes from HLO shapes, the
instructions outside fusions counted once with their operands, and model op names made short."""
import jax
import jax.numpy as jnp
import pytest

from conftest import ON_GPU

from t5x_variants.train import hlo_traffic


def test_array_bytes_of_arrays_and_tuples():
  assert hlo_traffic.array_bytes('bf16[16,512,768]{2,1,0:T(8,128)(2,1)}') == 16 * 512 * 768 * 2
  assert hlo_traffic.array_bytes('(f32[96]{0}, s32[], pred[3,4]{1,0})') == 96 * 4 + 4 + 12


@pytest.mark.skipif(ON_GPU, reason='the count reads XLA dots (TPU, CPU); a GPU compiles them to cuBLAS calls')
def test_a_matmul_counts_its_operands_and_output():
  """x (256 x 512) @ w (512 x 128) in float32 reads x and w and writes the product, whatever
  XLA fuses around it; the reduction beside it is counted apart."""
  f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  f = lambda x, w: (x @ w, jnp.sum(jnp.exp(x), axis=0))
  traffic = hlo_traffic.summary(jax.jit(f).lower(f32(256, 512), f32(512, 128)).compile().as_text())
  assert traffic['by_kind']['matmul'] == 4 * (256 * 512 + 512 * 128 + 256 * 128)
  assert traffic['total_bytes'] == sum(traffic['by_kind'].values())
  assert traffic['total_bytes'] >= traffic['by_kind']['matmul'] + 4 * 256 * 512
  assert ['matmul', 'dot_general', 1, traffic['by_kind']['matmul']] in traffic['by_source']


def test_op_names_fold_layers_and_mark_the_backward():
  name = ('jit(train_step)/while/body/closed_call/transpose(jvp(EncoderDecoder))/'
          'EncoderDecoder.encode/encoder/layers_3/self_attention/shard_map/pallas_call')
  assert hlo_traffic.source(name) == 'backward: EncoderDecoder.encode/encoder/layers_*/self_attention/pallas_call'
  assert hlo_traffic.source('jit(train_step)/jvp(EncoderDecoder)/EncoderDecoder.decode/decoder/'
                            'layers_11/mlp/wo/dot_general') == 'EncoderDecoder.decode/decoder/layers_*/mlp/wo/dot_general'
  assert hlo_traffic.source('jit(train_step)/while/body/closed_call/jit(_where)/select_n') == 'select_n'


def test_computations_are_found_with_or_without_a_percent_sign():
  """XLA's printers differ in whether a computation's header carries '%': both parse, so a fused
  dot is a matmul and what a fusion calls is not counted a second time."""
  text = '''HloModule m

fused_dot (p: bf16[8,8]) -> bf16[8,8] {
  %p = bf16[8,8]{1,0} parameter(0)
  ROOT %d = bf16[8,8]{1,0} dot(%p, %p), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (a: bf16[8,8]) -> bf16[8,8] {
  %a = bf16[8,8]{1,0} parameter(0)
  ROOT %gemm = bf16[8,8]{1,0} fusion(%a), kind=kCustom, calls=fused_dot
}
'''
  assert set(hlo_traffic.computations(text)) == {'fused_dot', 'main'}
  assert hlo_traffic.summary(text)['by_kind'] == {'matmul': 2 * 8 * 8 * 2}


def test_an_asynchronous_pair_counts_once_what_it_moves():
  """A TPU program's asynchronous slice, copy and collective-permute count at their done: the
  array written and what the start reads (a slice reads as much as it writes), not the start's
  tuple, which names the operand and the destination again (was: a slice counted its 6-row
  operand twice, and its done the whole tuple once more); a fusion that runs an all-reduce is a
  collective (was: 'other')."""
  text = '''HloModule m

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%all-reduce-scatter (input: f32[8,128]) -> f32[2,128] {
  %input = f32[8,128]{1,0} parameter(0)
  %all-reduce = f32[8,128]{1,0} all-reduce(%input), replica_groups={{0,1,2,3}}, to_apply=%add
  %c = s32[] constant(0)
  ROOT %ds = f32[2,128]{1,0} dynamic-slice(%all-reduce, %c, %c), dynamic_slice_sizes={2,128}
}

ENTRY %main (p: f32[6,128], q: f32[8,128]) -> f32[2,128] {
  %p = f32[6,128]{1,0} parameter(0)
  %q = f32[8,128]{1,0} parameter(1)
  %slice-start = ((f32[6,128]{1,0}), f32[2,128]{1,0:S(1)}, s32[]) slice-start(%p), slice={[0:2], [0:128]}
  %slice-done = f32[2,128]{1,0:S(1)} slice-done(%slice-start)
  %copy-start = (f32[8,128]{1,0:S(1)}, f32[8,128]{1,0}, u32[]) copy-start(%q)
  %copy-done = f32[8,128]{1,0:S(1)} copy-done(%copy-start)
  %cp-start = (f32[8,128]{1,0}, f32[8,128]{1,0}, u32[], u32[]) collective-permute-start(%copy-done), source_target_pairs={{0,1}}
  %cp-done = f32[8,128]{1,0} collective-permute-done(%cp-start)
  %rs = f32[2,128]{1,0} fusion(%cp-done), kind=kCustom, calls=%all-reduce-scatter, metadata={op_name="jit(f)/transpose(jvp())/dot_general"}
  ROOT %sum = f32[2,128]{1,0} add(%slice-done, %rs)
}
'''
  row = 128 * 4
  traffic = hlo_traffic.summary(text)
  assert traffic['by_kind'] == {'async copy': 2 * (2 * row) + 2 * (8 * row),
                                'collective': 2 * (8 * row) + (8 * row + 2 * row),
                                'other': 3 * (2 * row)}
  assert ['collective', 'backward: dot_general', 1, 10 * row] in traffic['by_source']


def test_a_wrapped_asynchronous_computation_counts_once():
  """'async-start' runs the computation it calls: counted at its done by what that runs (a
  reduce-scatter: a collective), the computation not again as top-level code (was: twice); a done
  reached through a tuple element or an 'async-update' finds its start (was: the start's tuple
  counted again)."""
  text = '''HloModule m

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%wrapped (p: f32[8,128]) -> f32[2,128] {
  %p = f32[8,128]{1,0} parameter(0)
  ROOT %rs = f32[2,128]{1,0} reduce-scatter(%p), dimensions={0}, to_apply=%add
}

ENTRY %main (x: f32[8,128], y: f32[2,128]) -> (f32[2,128], f32[8,128]) {
  %x = f32[8,128]{1,0} parameter(0)
  %y = f32[2,128]{1,0} parameter(1)
  %rs-start = ((f32[8,128]{1,0}), f32[2,128]{1,0}, s32[]) async-start(%x), calls=%wrapped
  %rs-update = ((f32[8,128]{1,0}), f32[2,128]{1,0}, s32[]) async-update(%rs-start)
  %rs-done = f32[2,128]{1,0} async-done(%rs-update)
  %ag-start = (f32[2,128]{1,0}, f32[8,128]{1,0}) all-gather-start(%y), dimensions={0}
  %ag = (f32[2,128]{1,0}, f32[8,128]{1,0}) bitcast(%ag-start)
  %ag-done = f32[8,128]{1,0} all-gather-done(%ag)
  ROOT %t = (f32[2,128]{1,0}, f32[8,128]{1,0}) tuple(%rs-done, %ag-done)
}
'''
  row = 128 * 4
  found = hlo_traffic.instructions(text)
  assert [(i.name, i.kind, i.bytes) for i in found] == [
      ('rs-done', 'collective', 2 * row + 8 * row), ('ag-done', 'collective', 8 * row + 2 * row)]
