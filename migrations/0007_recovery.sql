-- Recovery (issue 15): each job's relaunch budgets spent so far, counted apart as users of
-- torchrun and Ray ask (a lost or drained node is a preemption; a failed rank a restart), each
-- incremented in the transaction that moves the job to `recovering`; and every checkpoint
-- file's chunk size and per-chunk CRC-32C as its holder's manifest piece lists them, so a
-- restore verifies each copy it moves. Never edit once landed.

ALTER TABLE jobs ADD COLUMN preemptions BIGINT NOT NULL DEFAULT 0;
ALTER TABLE jobs ADD COLUMN restarts BIGINT NOT NULL DEFAULT 0;
ALTER TABLE ckpt_locations ADD COLUMN chunk_bytes BIGINT NOT NULL DEFAULT 0;
-- The CRC-32C of each chunk, as a JSON list of unsigned integers ('[]': not reported).
ALTER TABLE ckpt_locations ADD COLUMN crc32c TEXT NOT NULL DEFAULT '[]';
-- The checkpoint step a launch's ranks resume from (-1: none, they start at step 0).
ALTER TABLE plans ADD COLUMN restore_step BIGINT NOT NULL DEFAULT -1;
