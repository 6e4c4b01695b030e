"""Size limits shared by the file readers."""

# A gzip bomb must not be able to exhaust memory: real CIFAR members are ~30 MB.
MAX_MEMBER_BYTES = 1 << 30
