"""Reading XLA's optimised programs: which kernels a step launches, what crosses devices.

Works on the text of `jax.jit(f).lower(...).compile().as_text()`: the HLO after
XLA's fusion passes, where each top-level instruction (a fusion, a library call
such as a cuDNN convolution, a copy, a collective) is one kernel launch.
"""
import collections
import math
import re

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
# Instructions that launch nothing: bookkeeping, aliasing and the start half of async pairs.
NOT_KERNELS = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all",
               "partition-id", "replica-id", "opt-barrier", "add-dependency", "call", "while",
               "conditional", "copy-done", "send-done", "recv-done"}
_DTYPE_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1,
                "s16": 2, "u16": 2, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8,
                "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_SHAPE = re.compile(r"\b(" + "|".join(sorted(_DTYPE_BYTES, key=len, reverse=True))
                    + r")\[([\d,]*)\]")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")
_CALLED = re.compile(r"\b(?:to_apply|body|condition|true_computation|false_computation)="
                     r"%?([\w.\-]+)|branch_computations=\{([^}]*)\}")
_TARGET = re.compile(r'custom_call_target="([^"]+)"')


class Instruction(collections.namedtuple("Instruction", "name type opcode text")):
    """One HLO instruction: its result type (a shape or a tuple of shapes) and opcode."""


def parse_instruction(line: str):
    """'%x = f32[2]{0} add(%a, %b), ...' -> Instruction; None for anything else."""
    line = line.strip()
    if line.startswith("ROOT "):
        line = line[5:]
    name, sep, rhs = line.partition(" = ")
    if not sep or not rhs:
        return None
    if rhs.startswith("("):  # a tuple type, possibly nested
        depth = 0
        for end, char in enumerate(rhs):
            depth += {"(": 1, ")": -1}.get(char, 0)
            if depth == 0:
                break
        type_, rest = rhs[:end + 1], rhs[end + 1:].lstrip()
    else:
        type_, _, rest = rhs.partition(" ")
    opcode = rest.split("(", 1)[0].strip()
    if not opcode or " " in opcode:
        return None
    return Instruction(name.lstrip("%"), type_, opcode, rest)


def computations(hlo_text: str):
    """({computation name: [Instruction]}, entry computation name)."""
    bodies, entry, current = {}, None, None
    for line in hlo_text.splitlines():
        header = _HEADER.match(line)
        if header:
            current = header.group(2)
            bodies[current] = []
            if header.group(1):
                entry = current
        elif line.startswith("}"):
            current = None
        elif current is not None:
            instruction = parse_instruction(line)
            if instruction is not None:
                bodies[current].append(instruction)
    return bodies, entry


def _executed(hlo_text: str):
    """Instructions that run as top-level kernels: the entry computation's, and those of
    the computations it calls, loops over and branches to (each once), not fusions' insides."""
    bodies, entry = computations(hlo_text)
    seen, pending = set(), [entry]
    while pending:
        name = pending.pop()
        if name in seen or name not in bodies:
            continue
        seen.add(name)
        for instruction in bodies[name]:
            if instruction.opcode in ("call", "while", "conditional"):
                for single, several in _CALLED.findall(instruction.text):
                    pending.extend([single] if single else
                                   [n.strip().lstrip("%") for n in several.split(",")])
            yield instruction


def kernel_kind(instruction: Instruction) -> str:
    if instruction.opcode == "custom-call":
        target = _TARGET.search(instruction.text)
        return f"custom-call {target.group(1) if target else '?'}"
    return instruction.opcode.removesuffix("-start")


def kernel_counts(hlo_text: str) -> collections.Counter:
    """{kind: launches} for one execution (a loop body counted once): 'fusion',
    'custom-call <target>' (cuDNN, cuBLAS, Triton...), 'copy', collectives..."""
    return collections.Counter(kernel_kind(i) for i in _executed(hlo_text)
                               if i.opcode not in NOT_KERNELS and not i.opcode.endswith("-done"))


def type_bytes(type_: str) -> int:
    """Bytes of a shape or tuple of shapes, e.g. '(f32[10]{0}, bf16[4,2]{1,0})' -> 56."""
    return int(sum(_DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
                   for dtype, dims in _SHAPE.findall(type_)))


def collective_traffic(hlo_text: str) -> dict:
    """{collective: (ops, bytes)}: what one execution sends between devices, as the size
    of each collective's result on one device (an async pair counted by its -done half)."""
    traffic = {}
    for instruction in _executed(hlo_text):
        kind = instruction.opcode.removesuffix("-done")
        if kind not in COLLECTIVES:
            continue
        ops, size = traffic.get(kind, (0, 0))
        traffic[kind] = (ops + 1, size + type_bytes(instruction.type))
    return traffic
