-- Measured layer profiles (issue 14): what `python -m motley_torch.profile` wrote on an agent,
-- one row per (GPU type, model hash, tp, micro-batch, sequence length, data type, torch
-- version); a newer measurement of the same key replaces the row. The planner prices stages
-- from the newest row of each (gpu, model_hash, tp, micro_batch, seq_len, dtype).
-- Never edit once landed.

CREATE TABLE layer_profiles (
    id           BIGINT PRIMARY KEY,  -- from counters 'profile_id'
    gpu          TEXT NOT NULL,       -- GPU type name (the node's inventory)
    model        TEXT NOT NULL,       -- the model's name
    model_hash   TEXT NOT NULL,       -- sha256 of the model's canonical JSON (motley_torch.profile)
    tp           BIGINT NOT NULL,
    micro_batch  BIGINT NOT NULL,
    seq_len      BIGINT NOT NULL,
    dtype        TEXT NOT NULL,
    torch        TEXT NOT NULL,       -- torch version the profiler ran
    device       TEXT NOT NULL,       -- the device name torch reported
    node         TEXT NOT NULL,       -- where it was measured
    entry        TEXT NOT NULL,       -- the profiles file entry, JSON
    measured_at_ms BIGINT NOT NULL,
    UNIQUE (gpu, model_hash, tp, micro_batch, seq_len, dtype, torch)
);
CREATE INDEX layer_profiles_by_model ON layer_profiles (model_hash, seq_len, dtype);
INSERT INTO counters (name, value) VALUES ('profile_id', 0);
