//! Metis's inputs planned under Motley's own cost model.

use crate::inputs::InputError;
use crate::metis::Loaded;

pub fn run(_loaded: &Loaded, _union: bool, _json: bool) -> Result<String, InputError> {
    Err(InputError("--cost-model motley: not built yet".into()))
}
