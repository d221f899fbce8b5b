"""The load-time cost of verifying prepared data as it is read (issue 34): one 102 MB
`input_ids.npy` (400,000 rows of 128 uint16 token ids), loaded as before (SHA-256 of the file,
then a memory map) and as now (SHA-256 and, from the same bytes, a hash of every row:
`shard_reader.load`), CPU seconds, three times each.

    PYTHONPATH=. python benchmarks/read_check/load_cost.py
"""

import os
import tempfile
import time

import numpy as np

from bertjax.data import prepared_files, shard_reader


def main() -> None:
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "input_ids.npy")
        rows = np.random.default_rng(0).integers(0, 30000, (400_000, 128), dtype=np.uint16)
        np.save(path, rows)
        record = {"rows": len(rows), **prepared_files.file_record(path)}
        for _ in range(3):
            start = time.process_time()
            prepared_files.file_record(path)
            np.load(path, mmap_mode="r")
            before = time.process_time() - start
            start = time.process_time()
            shard_reader.load(path, record, "input_ids", rows.dtype, (128,), "")
            after = time.process_time() - start
            print(
                f"{os.path.getsize(path) / 1e6:.0f} MB: before (SHA-256, memory map) "
                f"{before:.3f} CPU s; after (SHA-256 and row hashes) {after:.3f} CPU s"
            )


if __name__ == "__main__":
    main()
