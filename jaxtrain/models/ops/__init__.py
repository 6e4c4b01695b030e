"""Layers and ops the models choose between (pooling, oneDNN convolutions on the CPU, a
lean BatchNorm), each with the plain XLA version it must agree with."""
