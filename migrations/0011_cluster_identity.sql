-- This cluster's identity (docs/state.md; docs/recovery.md, "Where checkpoint bytes live"): a
-- random name, made once by the first coordinator that finds it empty (UPDATE ... WHERE
-- cluster_id = '', then read back), so HA coordinators and restarts share it. A checkpoint
-- cloud is shared storage, and every cluster numbers its jobs from 1: a job's cloud prefix
-- carries the name (URL/CLUSTER/jobs/JOB/GEN/step-S), so two clusters never write over each
-- other's steps. Jobs numbered before this migration keep URL/jobs/JOB/...: their steps are
-- already there, and a recovery after the upgrade must find them. Never edit once landed.

CREATE TABLE cluster (
    id          BIGINT PRIMARY KEY,   -- always 1: one row
    cluster_id  TEXT NOT NULL,        -- '' until a coordinator names it
    first_job   BIGINT NOT NULL       -- the first job id whose cloud prefix carries cluster_id
);
INSERT INTO cluster (id, cluster_id, first_job) SELECT 1, '', value + 1 FROM counters WHERE name = 'job_id';
