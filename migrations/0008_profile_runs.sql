-- Profile runs the leader sent to agents (docs/state.md): durable, so a new leader knows which
-- runs are out (and which GPUs they measure on), takes their reports, and remembers which keys
-- failed lately instead of asking again at once. Ended runs are deleted once they are older
-- than a run's time limit. Never edit once landed.

CREATE TABLE profile_runs (
    request      BIGINT PRIMARY KEY,  -- from counters 'profile_run'; the agent's report names it
    gpu          TEXT NOT NULL,       -- GPU type name (the node's inventory)
    model        TEXT NOT NULL,
    model_hash   TEXT NOT NULL,
    tp           BIGINT NOT NULL,
    micro_batch  BIGINT NOT NULL,
    seq_len      BIGINT NOT NULL,
    dtype        TEXT NOT NULL,
    node         TEXT NOT NULL,
    gpus         TEXT NOT NULL,       -- the GPU indices measured on, a JSON list
    state        TEXT NOT NULL,       -- running, stored or failed
    profile      BIGINT,              -- stored: the layer_profiles row
    reason       TEXT,                -- failed: why
    started_ms   BIGINT NOT NULL,
    ended_ms     BIGINT
);
CREATE INDEX profile_runs_by_state ON profile_runs (state, node);
-- Request numbers continue past the leaders' earlier in-memory ones (wall-clock ms), so a
-- report of a run sent before this table existed is never taken for one sent after.
INSERT INTO counters (name, value) VALUES ('profile_run', 2000000000000);
