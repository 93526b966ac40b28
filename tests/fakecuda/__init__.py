"""A stand-in for NVIDIA's libcuda, a small GPU program and a fake cuda-checkpoint, for tests."""
