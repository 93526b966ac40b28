"""How a kernel is kept apart from the server's other processes, and what that allows CRIU.

- :mod:`.mountns`: the kernel's own mount namespace and ``/proc``;
- :mod:`.netns`: a network namespace for a copy whose ports are taken here;
- :mod:`.pidspace`: process ids for kernels without a PID namespace (no root);
- :mod:`.privatetmp`: a private temporary directory for a copy beside its original;
- :mod:`.confinement`: what this process's confinement (seccomp, capabilities, Yama)
  lets CRIU do.
"""
