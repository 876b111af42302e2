-- The data-plane key (docs/recovery.md, "Who may fetch"): 32 random bytes, hex, that sign the
-- capabilities the coordinator puts into each Restore and that agents check when peers fetch
-- checkpoint files. Generated once by the first coordinator that finds none (INSERT ... ON
-- CONFLICT DO NOTHING, then read back), so HA coordinators and restarts share one key and
-- capabilities stay valid across a failover. Never edit once landed.

CREATE TABLE secrets (
    name   TEXT PRIMARY KEY,   -- 'data_plane_key'
    value  TEXT NOT NULL       -- hex
);
