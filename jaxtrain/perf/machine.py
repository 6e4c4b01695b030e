"""Which CPU a figure was measured on: its model and the vector extensions that decide
which kernels XLA, oneDNN and torch run (an AVX-512 Xeon and an AVX2 EPYC differ by up
to 1.8x in the same test and round sums differently)."""
import platform

# The flags of /proc/cpuinfo that choose kernels, in the order they were added to x86.
VECTOR_EXTENSIONS = ("sse4_2", "avx", "avx2", "fma", "avx512f", "avx512bw", "avx512_vnni",
                     "avx512_bf16", "amx_tile", "amx_bf16")


def describe_cpu(cpuinfo: str = "/proc/cpuinfo") -> dict:
    """{'model': ..., 'vector_extensions': [...]}: from /proc/cpuinfo where there is one
    (Linux), else what platform knows and no extensions. The model is its name with its
    family and model numbers (a virtual machine may name only the vendor's line, e.g.
    'AMD EPYC (family 25, model 1)', family 25 being Zen 3 and 4)."""
    try:
        with open(cpuinfo) as f:
            text = f.read()
    except FileNotFoundError:
        return {"model": platform.processor() or platform.machine(), "vector_extensions": []}
    fields = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())  # the first processor's
    flags = set(fields.get("flags", "").split())
    model = fields.get("model name") or platform.processor() or platform.machine()
    if "cpu family" in fields and "model" in fields:
        model += f" (family {fields['cpu family']}, model {fields['model']})"
    return {"model": model,
            "vector_extensions": [name for name in VECTOR_EXTENSIONS if name in flags]}
