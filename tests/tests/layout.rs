//! The shape of the code: files readable in one sitting, no two modules that import each
//! other, and tools that link only what they use.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

#[test]
fn no_source_file_of_the_daemon_the_filesystem_libmaru_or_the_cluster_exceeds_1000_lines() {
    let mut long = Vec::new();
    for krate in ["daemon/src", "fsd/src", "libmaru/src", "cluster/src"] {
        let mut files = Vec::new();
        rust_files(&workspace().join(krate), &mut files);
        // Generated code (etcd's messages, cluster/proto/regen.sh) is not read in a sitting.
        files.retain(|f| !f.components().any(|c| c.as_os_str() == "pb"));
        for f in files {
            let n = std::fs::read_to_string(&f).unwrap().lines().count();
            if n > 1000 {
                long.push(format!("{} ({n} lines)", f.display()));
            }
        }
    }
    assert!(long.is_empty(), "over 1,000 lines: {long:?}");
}

/// A module's path in its crate (`["store", "pools", "raw"]`) from its file.
fn module_of(src: &Path, file: &Path) -> Vec<String> {
    let rel = file.strip_prefix(src).unwrap().with_extension("");
    let mut parts: Vec<String> = rel
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    if matches!(
        parts.last().map(String::as_str),
        Some("mod" | "lib" | "main")
    ) {
        parts.pop();
    }
    parts
}

/// The code of a file without comments and without its unit tests.
fn code(text: &str) -> String {
    let text = text.split("#[cfg(test)]").next().unwrap_or("");
    text.lines()
        .map(|l| l.split("//").next().unwrap_or(""))
        .collect::<Vec<_>>()
        .join("\n")
}

/// Identifiers chained by `::` starting at `at` (`a::b::{c, d}` gives [a, b] and [c, d]).
fn path_at(s: &str, at: usize) -> (Vec<String>, Vec<String>) {
    let b = s.as_bytes();
    let mut i = at;
    let mut segs = Vec::new();
    loop {
        let start = i;
        while i < b.len() && (b[i].is_ascii_alphanumeric() || b[i] == b'_') {
            i += 1;
        }
        if i == start {
            break;
        }
        segs.push(s[start..i].to_owned());
        if s[i..].starts_with("::") {
            i += 2;
            if s[i..].starts_with('{') {
                let end = s[i..].find('}').map_or(s.len(), |e| i + e);
                let items = s[i + 1..end]
                    .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                    .filter(|x| !x.is_empty())
                    .map(str::to_owned)
                    .collect();
                return (segs, items);
            }
        } else {
            break;
        }
    }
    (segs, Vec::new())
}

#[test]
fn no_two_modules_import_each_other() {
    let crates = [
        "libmaru/src",
        "fsd/src",
        "daemon/src",
        "tools/src",
        "tests/src",
        "bench/src",
        "cluster/src",
        "nixl/src",
        "remote/src",
        "python/src",
    ];
    let mut cycles = Vec::new();
    for krate in crates {
        let src = workspace().join(krate);
        let mut files = Vec::new();
        rust_files(&src, &mut files);
        files.retain(|f| !f.strip_prefix(&src).unwrap().starts_with("bin"));
        let mods: BTreeMap<Vec<String>, String> = files
            .iter()
            .map(|f| {
                (
                    module_of(&src, f),
                    code(&std::fs::read_to_string(f).unwrap()),
                )
            })
            .collect();
        let mut edges: BTreeSet<(Vec<String>, Vec<String>)> = BTreeSet::new();
        for (m, text) in &mods {
            let mut add = |target: Vec<String>| {
                if &target != m && mods.contains_key(&target) {
                    edges.insert((m.clone(), target));
                }
            };
            for (at, _) in text.match_indices("::") {
                // The path this `::` belongs to, from its first segment.
                let mut start = at;
                while start > 0 {
                    let c = text.as_bytes()[start - 1];
                    if c.is_ascii_alphanumeric() || c == b'_' || c == b':' {
                        start -= 1;
                    } else {
                        break;
                    }
                }
                if start != at && text[start..].starts_with(&text[start..at]) {
                    let (segs, items) = path_at(text, start);
                    let Some(first) = segs.first() else { continue };
                    let base: Vec<String> = match first.as_str() {
                        "crate" => Vec::new(),
                        "super" => m[..m.len().saturating_sub(1)].to_vec(),
                        "self" => m.clone(),
                        _ => m.clone(),
                    };
                    let rest: Vec<String> = match first.as_str() {
                        "crate" | "super" | "self" => segs[1..].to_vec(),
                        _ => segs.clone(),
                    };
                    // The longest prefix that names a module of the crate.
                    let mut found = false;
                    for k in (1..=rest.len()).rev() {
                        let mut t = base.clone();
                        t.extend_from_slice(&rest[..k]);
                        if mods.contains_key(&t) {
                            add(t);
                            found = true;
                            break;
                        }
                    }
                    if !found && matches!(first.as_str(), "crate" | "super") {
                        add(base.clone());
                    }
                    for item in items {
                        let mut t = base.clone();
                        t.extend_from_slice(&rest);
                        t.push(item);
                        add(t);
                    }
                }
            }
        }
        for (a, b) in &edges {
            if a < b && edges.contains(&(b.clone(), a.clone())) {
                cycles.push(format!("{krate}: {} <-> {}", a.join("/"), b.join("/")));
            }
        }
    }
    assert!(
        cycles.is_empty(),
        "modules that import each other: {cycles:?}"
    );
}

#[test]
fn maructl_links_neither_tokio_nor_fuser() {
    let out = std::process::Command::new(env!("CARGO"))
        .current_dir(workspace())
        .args([
            "tree",
            "-p",
            "maru-tools",
            "-e",
            "normal",
            "--prefix",
            "none",
            "--offline",
        ])
        .output()
        .expect("cargo tree");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let tree = String::from_utf8_lossy(&out.stdout);
    for name in ["tokio ", "fuser ", "maru-daemon ", "maru-fsd "] {
        assert!(
            !tree.lines().any(|l| l.starts_with(name)),
            "maru-tools depends on {name}"
        );
    }
}
