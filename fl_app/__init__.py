"""Framework-free core shared by the server and client sides: config, weight shards and
manifests, stores, fp32 aggregation, run directory. Imports nothing from the other packages."""
