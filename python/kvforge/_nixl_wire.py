"""The messages of kvforge.nixl's prepared pulls (_nixl_prepared.py, _nixl_pages.py): how they are written
and read.

Messages are NIXL notifications, each `_TAG` + a kind byte + a JSON head + raw int64 arrays:
  Q  receiver -> sender   a request: the cache key, the source's pages or row, the heads, the placement
                          (its scalars in the head, its block and runs arrays after it; in pages mode, the
                          receiver's variant and page count: _nixl_pages.py) and the receiver's agent
                          metadata, so that the sender can answer
  L  sender -> receiver   layer l is in the ring at address a
  E  sender -> receiver   the request was refused: a field and a message
  A  receiver -> sender   layer l was read (the notification of that layer's READ)
  C  receiver -> sender   the pull was abandoned (a timeout): the sender drops it
"""

import json
import struct

import numpy as np

import kvforge

_TAG = b"\x00kvf"


def encode(kind, head, *arrays):
    body = json.dumps(head).encode()
    return _TAG + kind + struct.pack("<I", len(body)) + body + b"".join(np.ascontiguousarray(a).tobytes()
                                                                       for a in arrays)


def decode(message):
    """(kind, head, the bytes after it), or None for a message that is not one of these."""
    if not message.startswith(_TAG) or len(message) < 9:
        return None
    size = struct.unpack_from("<I", message, 5)[0]
    try:
        head = json.loads(bytes(message[9:9 + size]))
    except ValueError:
        return None
    return message[4:5], head, bytes(message[9 + size:])


def served_cache(agent, head):
    """The cache a request names by its key, registered with this agent."""
    key = head["key"]
    if key not in agent._caches:
        raise kvforge.ArgumentError(f"key: {key!r} is not registered at {agent.name!r}")
    return agent._caches[key][0]
