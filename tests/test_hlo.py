"""Reading compiled XLA programs: instructions, kernels per execution, collective traffic."""
import jax
import jax.numpy as jnp

from jaxtrain.perf import hlo


def test_parse_instruction_handles_nested_tuple_types():
    line = ("  ROOT %while.5 = (s32[], (f32[4,8]{1,0}, bf16[2]{0})) while(%tuple.1), "
            "condition=%cond, body=%body")
    instruction = hlo.parse_instruction(line)
    assert instruction.name == "while.5" and instruction.opcode == "while"
    assert hlo.type_bytes(instruction.type) == 4 + 4 * 8 * 4 + 2 * 2
    assert hlo.parse_instruction("HloModule jit_f, is_scheduled=true") is None
    assert hlo.parse_instruction("}") is None


def test_kernels_of_a_real_program_count_a_loop_body_once():
    def step(x, w):
        return jnp.tanh(x @ w).sum(0, keepdims=True) + x

    def one(x, w):
        return step(x, w)

    def three(x, w):
        return jax.lax.fori_loop(0, 3, lambda i, x: step(x, w), x)

    args = (jnp.ones((4, 8)), jnp.ones((8, 8)))
    one_kernels = hlo.kernel_counts(jax.jit(one).lower(*args).compile().as_text())
    loop_text = jax.jit(three).lower(*args).compile().as_text()
    loop_kernels = hlo.kernel_counts(loop_text)
    assert sum(one_kernels.values()) >= 1
    # the loop body holds the step's kernels once (plus loop bookkeeping), not three times
    assert sum(one_kernels.values()) <= sum(loop_kernels.values()) < 3 * sum(one_kernels.values()) + 4
    bodies, entry = hlo.computations(loop_text)
    assert entry in bodies and any(i.opcode == "while" for i in bodies[entry])
    assert hlo.collective_traffic(loop_text) == {}


HLO = """
HloModule m, entry_computation_layout={(f32[10]{0})->f32[10]{0}}

%fused (p: f32[10]) -> f32[10] {
  %p = f32[10]{0} parameter(0)
  ROOT %all-reduce.9 = f32[10]{0} all-reduce(f32[10]{0} %p), to_apply=%add
}

%body (t: (s32[], f32[10])) -> (s32[], f32[10]) {
  %t = (s32[], f32[10]{0}) parameter(0)
  %g = f32[10]{0} get-tuple-element(%t), index=1
  %all-reduce.3 = f32[10]{0} all-reduce(f32[10]{0} %g), to_apply=%add
  ROOT %r = (s32[], f32[10]{0}) tuple(%i, %all-reduce.3)
}

ENTRY %main (x: f32[10]) -> f32[10] {
  %x = f32[10]{0} parameter(0)
  %all-reduce.1 = f32[3,3,64,256]{3,2,1,0} all-reduce(f32[3,3,64,256]{3,2,1,0} %p), to_apply=%add
  %all-reduce-start.2 = (f32[10]{0}, bf16[4,2]{1,0}) all-reduce-start(f32[10]{0} %a, bf16[4,2]{1,0} %b)
  %all-reduce-done.2 = (f32[10]{0}, bf16[4,2]{1,0}) all-reduce-done(%all-reduce-start.2)
  %all-gather.3 = u8[64,32,32,3]{3,2,1,0} all-gather(u8[8,32,32,3]{3,2,1,0} %x), dimensions={0}
  %fusion.4 = f32[10]{0} fusion(f32[10]{0} %x), kind=kLoop, calls=%fused
  %conv = bf16[8,16,16,64]{3,2,1,0} custom-call(%a, %b), custom_call_target="__cudnn$convForward"
  %w = (s32[], f32[10]{0}) while(%init), condition=%cond, body=%body
  ROOT %out = f32[10]{0} get-tuple-element(%w), index=1
}
"""


def test_collective_traffic_counts_each_collective_once_and_loop_bodies_too():
    assert hlo.collective_traffic(HLO) == {
        "all-reduce": (3, 3 * 3 * 64 * 256 * 4 + (10 * 4 + 8 * 2) + 10 * 4),
        "all-gather": (1, 64 * 32 * 32 * 3)}


def test_kernel_counts_name_library_calls_and_skip_fusion_insides():
    assert hlo.kernel_counts(HLO) == {"all-reduce": 3, "all-gather": 1, "fusion": 1,
                                      "custom-call __cudnn$convForward": 1}
