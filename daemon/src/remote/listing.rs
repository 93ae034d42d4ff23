//! A namespace's listing for a remote worker, a page at a time (`list`): a reply is one frame,
//! and a namespace may hold more names than a frame carries.
//!
//! The first page takes one look at the namespace (the store's `list`, under its lock once);
//! the connection keeps that look in a [`Cursor`] and serves the next pages from it, so a
//! listing of N names costs one pass of the store and no more, and its pages fit together
//! (names published or deleted meanwhile show in the next listing). A page that does not
//! continue the cursor (another namespace, another `after`) starts a new look.

use maru_remote::proto::{self, Listed, Listing};

/// The JSON bytes one page may take: half a frame, as a worker's requests.
pub(super) const PAGE_BYTES: usize = proto::MAX_FRAME / 2;

/// A listing read page by page.
pub(super) struct Cursor {
    ns: String,
    /// Sorted by name, as the store lists them; no name is both a child and an entry.
    children: Vec<String>,
    entries: Vec<Listed>,
    /// The next child and entry to send.
    next: (usize, usize),
    /// The last name sent (the `after` of the page that continues it).
    last: Option<String>,
}

impl Cursor {
    /// A listing of `ns`'s `children` and `entries` (each sorted), from the first name after
    /// `after`.
    pub(super) fn new(
        ns: String,
        children: Vec<String>,
        entries: Vec<Listed>,
        after: Option<&str>,
    ) -> Cursor {
        let next = match after {
            Some(a) => (
                children.partition_point(|c| c.as_str() <= a),
                entries.partition_point(|e| e.key.as_str() <= a),
            ),
            None => (0, 0),
        };
        Cursor {
            ns,
            children,
            entries,
            next,
            last: after.map(str::to_owned),
        }
    }

    /// Whether a request for `ns` after `after` asks for this cursor's next page.
    pub(super) fn continues(&self, ns: &str, after: Option<&str>) -> bool {
        self.ns == ns && after.is_some() && after == self.last.as_deref()
    }

    /// The next page: children and entries merged by name, at most [`proto::MAX_ITEMS`]
    /// names within `budget` bytes of JSON, at least one name when any remains; `more` when
    /// names remain after it.
    pub(super) fn next_page(&mut self, budget: usize) -> Listing {
        let (c0, e0) = self.next;
        let (mut c, mut e) = self.next;
        let mut used = 0;
        let more = loop {
            let child = self.children.get(c);
            let entry = self.entries.get(e);
            let (name, is_child) = match (child, entry) {
                (None, None) => break false,
                (Some(ch), Some(en)) if *ch < en.key => (ch.as_str(), true),
                (Some(ch), None) => (ch.as_str(), true),
                (_, Some(en)) => (en.key.as_str(), false),
            };
            // The name as JSON (quotes, escapes), a size, and the punctuation around them.
            let cost = serde_json::to_string(name).map_or(0, |s| s.len()) + 40;
            let taken = (c - c0) + (e - e0);
            if taken > 0 && (taken >= proto::MAX_ITEMS || used + cost > budget) {
                break true;
            }
            used += cost;
            self.last = Some(name.to_owned());
            if is_child {
                c += 1;
            } else {
                e += 1;
            }
        };
        self.next = (c, e);
        Listing {
            children: self.children[c0..c].to_vec(),
            entries: self.entries[e0..e].to_vec(),
            more,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(key: &str) -> Listed {
        Listed {
            key: key.into(),
            size: key.len() as u64,
        }
    }

    fn cursor(children: &[&str], entries: &[&str], after: Option<&str>) -> Cursor {
        Cursor::new(
            "ns".into(),
            children.iter().map(|c| (*c).to_owned()).collect(),
            entries.iter().map(|e| entry(e)).collect(),
            after,
        )
    }

    /// Every name of a listing, page after page, as a worker asks for them: the pages
    /// continue the first cursor (`fresh`: each page from a new cursor, as after a
    /// reconnection).
    fn all_pages(
        children: &[&str],
        entries: &[&str],
        budget: usize,
        fresh: bool,
    ) -> (Vec<String>, usize) {
        let (mut names, mut pages, mut after) = (Vec::new(), 0, None::<String>);
        let mut cur = cursor(children, entries, None);
        loop {
            if fresh {
                cur = cursor(children, entries, after.as_deref());
            } else if let Some(a) = &after {
                assert!(cur.continues("ns", Some(a)));
            }
            let p = cur.next_page(budget);
            pages += 1;
            let mut here: Vec<String> = p.children.clone();
            here.extend(p.entries.iter().map(|e| e.key.clone()));
            here.sort();
            assert!(
                !here.is_empty() || !p.more,
                "an empty page with more to come"
            );
            after = here.last().cloned().or(after);
            names.extend(here);
            if !p.more {
                return (names, pages);
            }
        }
    }

    #[test]
    fn a_listing_comes_in_pages_of_names_in_order() {
        for fresh in [false, true] {
            let (names, pages) = all_pages(&["b", "d"], &["a", "c", "e"], PAGE_BYTES, fresh);
            assert_eq!(names, ["a", "b", "c", "d", "e"]);
            assert_eq!(pages, 1);
            // A small budget: one name a page, none lost or repeated.
            let (names, pages) = all_pages(&["b", "d"], &["a", "c", "e"], 1, fresh);
            assert_eq!(names, ["a", "b", "c", "d", "e"]);
            assert_eq!(pages, 5);
        }
        // More names than a request's items: cut at the limit.
        let keys: Vec<String> = (0..proto::MAX_ITEMS + 10)
            .map(|i| format!("k{i:06}"))
            .collect();
        let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
        let first = cursor(&[], &keys, None).next_page(PAGE_BYTES);
        assert!(first.more && first.entries.len() == proto::MAX_ITEMS);
        let (names, pages) = all_pages(&[], &keys, PAGE_BYTES, false);
        assert_eq!((names.len(), pages), (keys.len(), 2));
        // Long names: within the budget's bytes of JSON.
        let long: Vec<String> = (0..5000)
            .map(|i| format!("{i:04}{}", "x".repeat(250)))
            .collect();
        let long: Vec<&str> = long.iter().map(String::as_str).collect();
        let p = cursor(&[], &long, None).next_page(PAGE_BYTES);
        let bytes = serde_json::to_vec(&p).unwrap().len();
        assert!(p.more && bytes <= PAGE_BYTES, "{bytes}");
        // After the last name: an empty last page.
        let p = cursor(&["z"], &["a"], Some("z")).next_page(PAGE_BYTES);
        assert_eq!(p, Listing::default());
    }

    #[test]
    fn only_the_page_after_the_last_continues_a_cursor() {
        let mut c = cursor(&["b"], &["a", "c"], None);
        assert!(!c.continues("ns", None));
        c.next_page(1);
        assert!(c.continues("ns", Some("a")));
        assert!(!c.continues("ns", Some("b")));
        assert!(!c.continues("other", Some("a")));
        assert!(!c.continues("ns", None));
    }
}
