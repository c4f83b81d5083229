"""The weight channel: how fp32 weights travel between the server and its nodes.

    put(local dir) -> ref        get(ref) -> local dir        (channel.Channel)

A `WeightsRef` names one member's weights in a call: inline arrays that ride in the Flower
message, or a store entry pinned by its manifest digest. The backends:

    channel.py       the Channel (put/get) and the inline backend
    store.py         the WeightStore interface every backend implements; key and digest rules
    run_dir.py       a directory: the run dir (simulation) or a disk every machine mounts
    remote.py        what the remote backends share: a node cache of verified entries, resumable
    http.py          the client of the store a ServerApp serves beside itself (http_server.py)
    credentials.py   the served store's per-call credentials: who may read and write which keys
    object_store.py  any fsspec URL: S3, MinIO, GCS, ...
    open.py          one config value -> the store it names
    files.py         the file operations every backend writes entries with
"""

from fl_app.channel.channel import (
    CACHE_KEEP,
    Channel,
    State,
    WeightsRef,
    arrays_key,
    sees_disk_probe,
    write_disk_probe,
)

__all__ = ["CACHE_KEEP", "Channel", "State", "WeightsRef", "arrays_key", "sees_disk_probe", "write_disk_probe"]
