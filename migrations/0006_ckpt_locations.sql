-- The checkpoint-location bitmap (issue 15): which checkpoint file of which step of a job each
-- node holds, in which tier, as its agent last reported (the whole list each time, replacing
-- the node's rows). Written only under the reporting session's agent epoch: a stale agent's
-- report changes nothing. Never edit once landed.

CREATE TABLE ckpt_locations (
    job_id      BIGINT NOT NULL,
    generation  BIGINT NOT NULL,      -- the launch whose ranks wrote it
    step        BIGINT NOT NULL,
    file        TEXT NOT NULL,        -- its name in the step's directory
    node        TEXT NOT NULL,
    tier        TEXT NOT NULL,        -- memory | disk | cloud
    bytes       BIGINT NOT NULL,
    block       TEXT NOT NULL,        -- embed | layer.N | head ('' for a rank file)
    part        TEXT NOT NULL,        -- model | optimizer ('' for a rank file)
    tp_rank     BIGINT NOT NULL,
    tp_size     BIGINT NOT NULL,
    rank        BIGINT NOT NULL,      -- a rank file's rank, -1 for a unit
    layers      BIGINT NOT NULL,      -- the step's model layers (from its manifest)
    world_size  BIGINT NOT NULL,      -- ranks that wrote the step
    agent_epoch BIGINT NOT NULL,
    reported_at_ms BIGINT NOT NULL,
    PRIMARY KEY (job_id, step, file, node, tier)
);
CREATE INDEX ckpt_locations_by_node ON ckpt_locations (node);
