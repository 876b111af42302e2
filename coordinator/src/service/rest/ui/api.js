// The coordinator's REST API as the dashboard calls it: the operators' token from this tab's
// session (never in a URL), sent as `Authorization: Bearer`; a standby's 503 names the leader,
// and the dashboard goes there.

const KEY = 'motley.token';

/** The coordinator refused the token (401 or 403). */
export class AuthError extends Error {}

export function token() {
  return sessionStorage.getItem(KEY);
}

export function setToken(t) {
  if (t) sessionStorage.setItem(KEY, t);
  else sessionStorage.removeItem(KEY);
}

/**
 * One call of `/api/v1${path}`: the parsed JSON (or the text with `{text: true}`); with
 * `{headers: true}`, `{text, headers}` (the body so read, and the response's headers).
 * @param {string} path
 * @param {{method?: string, text?: boolean, headers?: boolean}} [opts]
 */
export async function api(path, opts = {}) {
  const headers = {};
  const t = token();
  if (t) headers.Authorization = `Bearer ${t}`;
  const res = await fetch(`/api/v1${path}`, { method: opts.method || 'GET', headers, cache: 'no-store' });
  if (res.ok) {
    const body = await (opts.text ? res.text() : res.json());
    // With `headers: true`, the body and the response's headers.
    return opts.headers ? { text: body, headers: res.headers } : body;
  }
  const body = await res.json().catch(() => ({}));
  const message = body.error || `${res.status} ${res.statusText}`;
  if (res.status === 401 || res.status === 403) throw new AuthError(message);
  if (res.status === 503 && body.leader) followLeader(body.leader);
  const e = new Error(message);
  e.status = res.status;
  throw e;
}

/** A standby serves this page but not the API: open the same page on the leader. */
function followLeader(url) {
  let target;
  try {
    target = new URL(url);
  } catch {
    return;
  }
  if (target.origin === location.origin || !/^https?:$/.test(target.protocol)) return;
  document.getElementById('status').textContent = `This coordinator is a standby; going to the leader at ${target.origin}`;
  location.assign(`${target.origin}/${location.hash}`);
}
