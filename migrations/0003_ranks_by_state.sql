-- The job queue looks every base interval for ranks still running whose job is over (their
-- GPUs are not free until the ranks exit): find them without reading every rank ever run.
CREATE INDEX ranks_by_state ON ranks (state, job_id);
