//! Motley's pictures, pure renderers (text in, SVG text out, the same input always the same
//! bytes): a plan document as a row per replica with its stages and a 1F1B timeline of one
//! iteration (`svg`, for `motley plan --svg` and the coordinator's `plan.svg`), and a job's
//! training curves (`curves`, for `GET /api/v1/jobs/{id}/curves.svg`). They read the documents
//! of `motley_contract` and nothing else.

pub mod curves;
pub mod svg;
