"""Moved to ``kraken.runtime.library``; kept so that ``from kraken import library`` still works (the same objects)."""

from kraken.runtime.library import (  # noqa: F401
    ENTRIES, NAMESPACES, SCHEMA_TYPES, Entry, as_list, decode_config, encode_config, front_door, gathered,
    gathered_matmul, gathered_matmul_fp8, gemm_all_reduced, gemm_scattered, group_name, in_place,
    install_front_doors, like_first, register, scattered, schema_of, world_size, writes_first,
)
