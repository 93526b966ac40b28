"""A stand-in for NVIDIA's libcuda, a small GPU program and a fake cuda-checkpoint, for tests;
what a kernel runs to use it (programs.py), and a stand-in pynvml (nvml.py)."""
