//! The REST API's OpenAPI document (`/api/v1/openapi.json`), derived from the handlers'
//! annotations so it cannot drift from the routes.

use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::{Modify, OpenApi};

#[derive(OpenApi)]
#[openapi(
    info(title = "Motley coordinator", description = "Control API: nodes, jobs, plans, layer profiles, the link matrix. Every call needs `Authorization: Bearer TOKEN` unless the coordinator runs with --insecure; a standby answers 503 with the leader's URL."),
    paths(
        super::nodes::list, super::nodes::get, super::nodes::declare, super::nodes::remove, super::nodes::drain, super::nodes::undrain,
        super::jobs::list, super::jobs::submit, super::jobs::get, super::jobs::cancel, super::jobs::events,
        super::jobs::plan, super::jobs::plan_svg, super::jobs::dry_run, super::jobs::logs, super::jobs::curves, super::jobs::curves_svg, super::leader,
        super::checkpoints::list, super::checkpoints::grid,
        super::profiles::list, super::profiles::get, super::profiles::run, super::profiles::runs, super::profiles::run_state,
        super::net::show,
    ),
    modifiers(&Bearer),
    security(("bearer" = []))
)]
struct ApiDoc;

struct Bearer;

impl Modify for Bearer {
    fn modify(&self, doc: &mut utoipa::openapi::OpenApi) {
        let components = doc.components.get_or_insert_with(Default::default);
        components.add_security_scheme("bearer", SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()));
    }
}

/// The document.
pub fn document() -> utoipa::openapi::OpenApi {
    ApiDoc::openapi()
}
