"""Where a run keeps its files, and local files written safely.

Modules, by role:
  filesystem a local or NFS directory, or a URI on any pyarrow filesystem (s3://, gs://, ...): `location()` and the
            few operations raysft needs on a run directory (`Location`)
  files     a directory built beside its final name and renamed into place, a hash taken while streaming, scratch
            files
"""

from raysft.storage.files import built_then_renamed, hash_stream, scratch_file
from raysft.storage.filesystem import Location, is_remote, location, native, resolve, use_filesystem

__all__ = ["Location", "built_then_renamed", "hash_stream", "is_remote", "location", "native", "resolve",
           "scratch_file", "use_filesystem"]
