"""ALFWorld on the real engine (alfworld 0.4.2 on textworld 1.7.0) with locally generated games.

    engine.py      the only door to alfworld/textworld: home hygiene, the engine lock, memos
    rooms.py       the 120 shipped AI2-THOR room inventories
    tasks.py       ALFRED task sampling, room population, the PDDL problem
    planning.py    the expert: ALFWorld's planner on ALFRED's task-relevant projection
    generate.py    game sets in the official layout, cached, pinned (python -m envs.alfworld.generate)
    manifest.py    per-split manifests (python -m envs.alfworld.manifest)
    games.py       the served game order (generated or official data, one loader)
    env.py         AlfworldEnv (the Env protocol)
    validation.py  per_type_breakdown of one validation pass

Submodules are imported on use so that `envs.alfworld.manifest` stays light.
"""
