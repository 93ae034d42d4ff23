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
        let src = std::fs::read_to_string(root.join("tests").join(format!("{file}.rs")))
            .unwrap_or_else(|_| panic!("SEMANTICS.md names tests/{file}.rs, which does not exist"));
        assert!(
            src.contains(&format!("fn {func}()")),
            "SEMANTICS.md names {file}::{func}, which does not exist"
        );
        named += 1;
    }
    assert!(named > 20, "only {named} tests named");
}
