"""docs/architecture.md is the map of the house: every room it names exists, and every crate of
the workspace and every module of the rank library is on it. A room renamed, moved or added
without the map fails here."""

import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MAP = os.path.join(REPO, "docs", "architecture.md")


def sections() -> dict:
    """Each `## ` heading's table rows, as lists of the names in backticks of the first column."""
    out, current = {}, None
    with open(MAP) as f:
        for line in f:
            if line.startswith("## "):
                current = line[3:].strip()
                out[current] = []
            elif current and line.startswith("| `"):
                first = line.split("|")[1]
                out[current].append(re.findall(r"`([^`]+)`", first))
    return out


def section(title_start: str) -> list:
    found = [rows for title, rows in sections().items() if title.startswith(title_start)]
    assert len(found) == 1, f"docs/architecture.md: one section '{title_start}...' expected"
    assert found[0], f"docs/architecture.md: '{title_start}' has no table of rooms"
    return [name for row in found[0] for name in row]


def rust_room_exists(src: str, name: str) -> bool:
    path = os.path.join(src, name.rstrip("/").replace("::", "/"))
    return os.path.isdir(path) or os.path.isfile(path + ".rs")


def test_every_rust_room_named_on_the_map_exists():
    for title, crate in (("The coordinator", "coordinator"), ("The agent", "agent")):
        src = os.path.join(REPO, crate, "src")
        missing = [n for n in section(title) if not rust_room_exists(src, n)]
        assert not missing, f"docs/architecture.md names rooms {crate}/src lacks: {missing}"


def test_every_python_module_is_on_the_map_and_every_room_named_is_a_module():
    pkg = os.path.join(REPO, "python", "motley_torch")
    modules = {f[:-3] for f in os.listdir(pkg) if f.endswith(".py") and f != "__init__.py"}
    packages = {d + "/" for d in os.listdir(pkg) if os.path.isfile(os.path.join(pkg, d, "__init__.py"))}
    named = set(section("The rank library"))
    rooms = modules | packages
    assert not named - rooms, f"docs/architecture.md names rooms motley_torch lacks: {sorted(named - rooms)}"
    assert not rooms - named, f"rooms of motley_torch missing from docs/architecture.md: {sorted(rooms - named)}"
    # Each package's row names every module in it.
    rows = {}
    with open(MAP) as f:
        for line in f:
            first = line.split("|")[1] if line.startswith("| `") else ""
            for p in packages:
                if f"`{p}`" in first:
                    rows[p] = line
    for p in packages:
        inside = {f[:-3] for f in os.listdir(os.path.join(pkg, p)) if f.endswith(".py") and f != "__init__.py"}
        unnamed = sorted(m for m in inside if f"`{m}`" not in rows[p])
        assert not unnamed, f"docs/architecture.md: the row of motley_torch/{p} does not name {unnamed}"


def test_every_crate_and_top_level_room_is_on_the_map():
    with open(os.path.join(REPO, "Cargo.toml")) as f:
        members = re.search(r"members\s*=\s*\[([^\]]*)\]", f.read()).group(1)
    crates = {m.strip().strip('"') for m in members.split(",") if m.strip()}
    named = {n.rstrip("/") for n in section("The rest of the house")}
    assert crates - named == set(), f"crates missing from docs/architecture.md: {sorted(crates - named)}"
    missing = sorted(n for n in named if not os.path.isdir(os.path.join(REPO, n)))
    assert not missing, f"docs/architecture.md names directories the repository lacks: {missing}"


def test_the_map_check_fails_on_a_room_that_is_not_there(tmp_path):
    # The check itself can fail: a name that is no room is found missing.
    src = os.path.join(REPO, "agent", "src")
    assert rust_room_exists(src, "ranks/") and rust_room_exists(src, "safe_fs")
    assert not rust_room_exists(src, "no_such_room")
