-- The checkpoint-location bitmap keyed by generation too: a step that one launch saved (and
-- lost a node mid-save) and the next launch saved again is two copies of the step, not one.
-- Keyed without the generation, the older launch's row won a conflict and a restore could mix
-- the two launches' files. A restore takes a step from one generation (docs/recovery.md). The
-- table is recreated with the wider key, keeping every row. Also the source generation a
-- recovery's launch restores (its ranks check the files they load were written by it).
-- Never edit once landed.

CREATE TABLE ckpt_locations_g (
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
    chunk_bytes BIGINT NOT NULL DEFAULT 0,
    crc32c      TEXT NOT NULL DEFAULT '[]',  -- JSON list of each chunk's CRC-32C
    PRIMARY KEY (job_id, generation, step, file, node, tier)
);
INSERT INTO ckpt_locations_g (job_id, generation, step, file, node, tier, bytes, block, part, tp_rank, tp_size, rank,
                              layers, world_size, agent_epoch, reported_at_ms, chunk_bytes, crc32c)
    SELECT job_id, generation, step, file, node, tier, bytes, block, part, tp_rank, tp_size, rank,
           layers, world_size, agent_epoch, reported_at_ms, chunk_bytes, crc32c
    FROM ckpt_locations;
DROP TABLE ckpt_locations;
ALTER TABLE ckpt_locations_g RENAME TO ckpt_locations;
CREATE INDEX ckpt_locations_by_node ON ckpt_locations (node);
-- The generation whose files a launch's ranks restore (-1: none, or a launch from before this).
ALTER TABLE plans ADD COLUMN restore_generation BIGINT NOT NULL DEFAULT -1;
