//! A production function a reader can hold (issue 52): at most 80 lines
//! from its signature to its closing brace, read from the sources
//! themselves, so a new long function fails here, not in a review. The few
//! left longer are flat matches, each named below with its reason.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use syn::spanned::Spanned;
use syn::visit::{self, Visit};

const LIMIT: usize = 80;

/// (file, function, why): at most three, each an evident flat `match`.
const ALLOWED: &[(&str, &str, &str)] = &[];

/// The production sources: the operator, the process node, the stand-ins.
const ROOTS: &[&str] = &["src", "e2e/node", "e2e/standins"];

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// Every .rs file under `dir`, but for test files: `tests/` folders and
/// `tests.rs` (the other test modules are found from their `mod`).
fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|entry| entry.expect("entry").path())
        .collect();
    entries.sort();
    for path in entries {
        let name = path
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default();
        if path.is_dir() {
            if name != "tests" && name != "target" {
                rust_files(&path, out);
            }
        } else if name.ends_with(".rs") && name != "tests.rs" {
            out.push(path);
        }
    }
}

/// Whether the attributes keep an item to test builds: `#[cfg(test)]`,
/// `#[cfg(all(test, ..))]` or `#[test]`.
fn test_only(attrs: &[syn::Attribute]) -> bool {
    fn needs_test(meta: &syn::Meta) -> bool {
        match meta {
            syn::Meta::Path(path) => path.is_ident("test"),
            syn::Meta::List(list) if list.path.is_ident("all") => list
                .parse_args_with(
                    syn::punctuated::Punctuated::<syn::Meta, syn::Token![,]>::parse_terminated,
                )
                .is_ok_and(|metas| metas.iter().any(needs_test)),
            _ => false,
        }
    }
    attrs.iter().any(|attr| {
        attr.path().is_ident("test")
            || attr.path().is_ident("cfg")
                && attr.parse_args::<syn::Meta>().is_ok_and(|m| needs_test(&m))
    })
}

struct Long {
    file: String,
    name: String,
    lines: usize,
}

/// Walks one file: measures every function with a body, and notes the
/// files of its `#[cfg(test)] mod x;` declarations.
struct Measure<'a> {
    file: &'a str,
    owner: Option<String>,
    test_mods: Vec<String>,
    long: Vec<Long>,
}

impl Measure<'_> {
    fn measure(&mut self, name: &syn::Ident, start: proc_macro2::Span, block: &syn::Block) {
        let lines = block.brace_token.span.close().end().line - start.start().line + 1;
        if lines > LIMIT {
            let name = match &self.owner {
                Some(owner) => format!("{owner}::{name}"),
                None => name.to_string(),
            };
            self.long.push(Long {
                file: self.file.to_string(),
                name,
                lines,
            });
        }
    }

    /// Where the item starts after its attributes: its visibility if any.
    fn start(vis: &syn::Visibility, sig: &syn::Signature) -> proc_macro2::Span {
        match vis {
            syn::Visibility::Inherited => sig.span(),
            vis => vis.span(),
        }
    }

    fn within<T>(&mut self, owner: Option<String>, walk: impl FnOnce(&mut Self) -> T) -> T {
        let outer = std::mem::replace(&mut self.owner, owner);
        let out = walk(self);
        self.owner = outer;
        out
    }
}

fn type_name(ty: &syn::Type) -> String {
    match ty {
        syn::Type::Path(path) => path
            .path
            .segments
            .last()
            .map(|s| s.ident.to_string())
            .unwrap_or_default(),
        _ => "_".to_string(),
    }
}

impl<'ast> Visit<'ast> for Measure<'_> {
    fn visit_item_mod(&mut self, item: &'ast syn::ItemMod) {
        if !test_only(&item.attrs) {
            visit::visit_item_mod(self, item);
        } else if item.content.is_none() {
            self.test_mods.push(item.ident.to_string());
        }
    }

    fn visit_item_fn(&mut self, item: &'ast syn::ItemFn) {
        if test_only(&item.attrs) {
            return;
        }
        self.measure(
            &item.sig.ident,
            Self::start(&item.vis, &item.sig),
            &item.block,
        );
        self.within(None, |me| visit::visit_item_fn(me, item));
    }

    fn visit_item_impl(&mut self, item: &'ast syn::ItemImpl) {
        if !test_only(&item.attrs) {
            let owner = type_name(&item.self_ty);
            self.within(Some(owner), |me| visit::visit_item_impl(me, item));
        }
    }

    fn visit_item_trait(&mut self, item: &'ast syn::ItemTrait) {
        if !test_only(&item.attrs) {
            let owner = item.ident.to_string();
            self.within(Some(owner), |me| visit::visit_item_trait(me, item));
        }
    }

    fn visit_impl_item_fn(&mut self, item: &'ast syn::ImplItemFn) {
        if test_only(&item.attrs) {
            return;
        }
        self.measure(
            &item.sig.ident,
            Self::start(&item.vis, &item.sig),
            &item.block,
        );
        self.within(None, |me| visit::visit_impl_item_fn(me, item));
    }

    fn visit_trait_item_fn(&mut self, item: &'ast syn::TraitItemFn) {
        if test_only(&item.attrs) {
            return;
        }
        if let Some(block) = &item.default {
            self.measure(&item.sig.ident, item.sig.span(), block);
        }
        self.within(None, |me| visit::visit_trait_item_fn(me, item));
    }
}

/// The files a `mod name;` in `file` may be: beside it (a crate root or a
/// `mod.rs`) or in the folder named after it.
fn module_files(file: &Path, name: &str) -> Vec<PathBuf> {
    let dir = file.parent().expect("a folder");
    let stem = file
        .file_stem()
        .and_then(|s| s.to_str())
        .unwrap_or_default();
    [dir.to_path_buf(), dir.join(stem)]
        .into_iter()
        .flat_map(|d| [d.join(format!("{name}.rs")), d.join(name).join("mod.rs")])
        .collect()
}

/// Every production function over the limit, allowed or not.
fn long_functions() -> Vec<Long> {
    let mut files = Vec::new();
    for dir in ROOTS {
        rust_files(&root().join(dir), &mut files);
    }
    let mut test_files = BTreeSet::new();
    let mut measured = Vec::new();
    for path in &files {
        let text = std::fs::read_to_string(path).expect("source");
        let ast = syn::parse_file(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let relative = path.strip_prefix(root()).expect("under the root");
        let file = relative.to_string_lossy().replace('\\', "/");
        let mut measure = Measure {
            file: &file,
            owner: None,
            test_mods: Vec::new(),
            long: Vec::new(),
        };
        measure.visit_file(&ast);
        for name in &measure.test_mods {
            test_files.extend(module_files(path, name));
        }
        measured.push((path.clone(), measure.long));
    }
    measured
        .into_iter()
        .filter(|(path, _)| !test_files.contains(path))
        .flat_map(|(_, long)| long)
        .collect()
}

#[test]
fn no_production_function_is_over_80_lines() {
    assert!(
        ALLOWED.len() <= 3,
        "at most three long functions are allowed"
    );
    let long = long_functions();
    let offenders: Vec<String> = long
        .iter()
        .filter(|l| {
            !ALLOWED
                .iter()
                .any(|(file, name, _)| *file == l.file && *name == l.name)
        })
        .map(|l| format!("  {}: {} is {} lines", l.file, l.name, l.lines))
        .collect();
    assert!(
        offenders.is_empty(),
        "functions over {LIMIT} lines (split them into parts a reader can hold, \
         the deciding apart from the writing):\n{}",
        offenders.join("\n")
    );
}

/// An allowed function that got short or was renamed leaves the list.
#[test]
fn every_allowed_function_is_still_long() {
    let long = long_functions();
    for (file, name, _) in ALLOWED {
        assert!(
            long.iter().any(|l| l.file == *file && l.name == *name),
            "{file}: {name} is no longer over {LIMIT} lines (or is gone): take it off ALLOWED"
        );
    }
}
