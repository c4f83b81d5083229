"""Task partitions across clients: pure, seeded, machine-independent functions of their inputs.

Nothing here imports from the Flower side or the envs; every client recomputes the same global
assignment and takes its own slice (invariant 11).
"""
