"""The native CPU kernels: their build (build), the loaded library (library), its Python entry points (ops),
the PyTorch formulations they are checked against (reference) and the timed choice of which run
(choice)."""
