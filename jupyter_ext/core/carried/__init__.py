"""What a snapshot carries besides memory, and what a restore needs free for it.

CRIU saves a process tree's memory by itself; what the tree holds outside its memory
needs the product's help to come back, on this machine or another:

- :mod:`.shmfiles`: ``/dev/shm`` files and named semaphores, copied into the snapshot;
- :mod:`.appended`: log files the kernel appends to, carried as they were at the dump;
- :mod:`.filelocks`: ``flock``/``fcntl`` locks a restore would wait for;
- :mod:`.netports`: the listening and bound ports, checked free before a restore;
- :mod:`.tcpconns`: connections inside the tree, kept established across restores;
- :mod:`.timewait`: TIME_WAIT entries of the kernel's own ended connections, cleared;
- :mod:`.waits`: timed waits a dump interrupted, restarted instead of failing;
- :mod:`.sockdiag`: the socket facts (sock_diag netlink) the others read;
- :mod:`.restorable`: a dump's images changed for what the others carry.
"""
