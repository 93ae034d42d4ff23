//! doc/SEMANTICS.md names the test behind each claim; every named test must exist.

#[test]
fn every_claim_names_an_existing_test() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let doc = std::fs::read_to_string(root.join("../doc/SEMANTICS.md")).unwrap();
    let mut named = 0;
    for cell in doc.split('`') {
        let Some((file, func)) = cell.split_once("::") else {
            continue;
        };
        if !func.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') || file.contains(' ') {
            continue;
        }
        // End-to-end tests live in tests/tests/, in-process ones of the daemon in daemon/tests/.
        let src = [root.join("tests"), root.join("../daemon/tests")]
            .iter()
            .find_map(|d| std::fs::read_to_string(d.join(format!("{file}.rs"))).ok())
            .unwrap_or_else(|| panic!("SEMANTICS.md names {file}.rs, which does not exist"));
        assert!(
            src.contains(&format!("fn {func}()")),
            "SEMANTICS.md names {file}::{func}, which does not exist"
        );
        named += 1;
    }
    assert!(named > 20, "only {named} tests named");
}
