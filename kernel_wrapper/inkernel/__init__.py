"""What runs inside the user's kernel process, kept apart from the wrapper's modules.

The wrapper starts ``python -m kernel_wrapper.inkernel.inner``: ipykernel, made ready for
CRIU (:mod:`.inner`), with the snapshot agent thread (:mod:`.agent`) and its summary of
what a snapshot holds (:mod:`.contents`). They run in the user's process, in every kernel,
and are dumped with it, so they import only what a kernel has anyway (ipykernel, zmq) and
the core's plain modules, never a wrapper module (tests/test_shape.py checks it), and they
never touch the wrapper's state: they talk to the wrapper over the kernel's sockets only.
"""
