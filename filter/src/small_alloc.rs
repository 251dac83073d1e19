//! A small size-class cache in front of std's allocator (dlmalloc on wasm32).
//!
//! A request allocates a dozen small blocks (the header map the host copies in, shared-data
//! values, counter keys, the rendered fields) and frees them all before the next. dlmalloc
//! spends ~210 guest instructions on each malloc/free pair, and the wasm allocator crates
//! measured more (talc, rlsf: +1,100–1,400 instructions per request). Here a block of up to
//! 256 bytes is taken from, and given back to, a free list of its size class: a few
//! instructions each. Hand-written because it sits in front of dlmalloc rather than replacing
//! it: larger blocks, and the lists' overflow, go to dlmalloc as before.
//!
//! Memory stays bounded: each class keeps at most [`KEEP`] free blocks (31 KB in all), and
//! what is freed beyond that returns to dlmalloc.

// Natively the allocator is only exercised by its tests.
#![cfg_attr(not(target_arch = "wasm32"), allow(dead_code))]

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::UnsafeCell;
use std::ptr;

/// Size classes 16, 32, 64, 128 and 256 bytes.
const CLASSES: usize = 5;
const MAX_SIZE: usize = 16 << (CLASSES - 1);
/// Every cached block is aligned to this (dlmalloc's own alignment on wasm32 is 8).
const ALIGN: usize = 16;
/// Free blocks kept per class.
const KEEP: u32 = 64;

struct Lists {
    head: [*mut u8; CLASSES],
    count: [u32; CLASSES],
}

/// The global allocator of the filter on wasm32.
pub struct CachedAlloc(UnsafeCell<Lists>);

// SAFETY: wasm32 without the atomics feature runs a single thread; the lists are never
// reached from two threads. (Natively the type is only used in its single-threaded tests.)
#[cfg(all(target_arch = "wasm32", not(target_feature = "atomics")))]
unsafe impl Sync for CachedAlloc {}

impl CachedAlloc {
    /// An allocator with empty lists.
    pub const fn new() -> CachedAlloc {
        CachedAlloc(UnsafeCell::new(Lists { head: [ptr::null_mut(); CLASSES], count: [0; CLASSES] }))
    }
}

/// The class of a layout, if cached.
fn class(size: usize, align: usize) -> Option<usize> {
    if size > MAX_SIZE || align > ALIGN {
        return None;
    }
    let rounded = size.max(16).next_power_of_two();
    Some(rounded.trailing_zeros() as usize - 4)
}

/// The layout every block of class `c` is allocated from dlmalloc with.
fn class_layout(c: usize) -> Option<Layout> {
    Layout::from_size_align(16 << c, ALIGN).ok()
}

// SAFETY: every block handed out comes from `System` with at least the layout asked for
// (a class's layout covers any size and alignment mapped to it), and a block is only reused
// for a layout of the same class or handed back to `System` with the layout it came with.
unsafe impl GlobalAlloc for CachedAlloc {
    #[inline(never)]
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let Some(c) = class(layout.size(), layout.align()) else {
            // SAFETY: forwarded as given.
            return unsafe { System.alloc(layout) };
        };
        // SAFETY: one thread (see `Sync`), and no reference to the lists outlives this call.
        let lists = unsafe { &mut *self.0.get() };
        if let (Some(head), Some(count)) = (lists.head.get_mut(c), lists.count.get_mut(c)) {
            let block = *head;
            if !block.is_null() {
                // SAFETY: a free block of this class holds the next free block's address in
                // its first bytes (written by `dealloc`), and is 16-aligned.
                *head = unsafe { *block.cast::<*mut u8>() };
                *count -= 1;
                return block;
            }
        }
        match class_layout(c) {
            // SAFETY: a valid non-zero layout.
            Some(l) => unsafe { System.alloc(l) },
            None => ptr::null_mut(),
        }
    }

    #[inline(never)]
    unsafe fn dealloc(&self, block: *mut u8, layout: Layout) {
        let Some(c) = class(layout.size(), layout.align()) else {
            // SAFETY: allocated by `System` with this layout (see `alloc`).
            return unsafe { System.dealloc(block, layout) };
        };
        // SAFETY: as in `alloc`.
        let lists = unsafe { &mut *self.0.get() };
        if let (Some(head), Some(count)) = (lists.head.get_mut(c), lists.count.get_mut(c)) {
            if *count < KEEP {
                // SAFETY: the block is at least 16 bytes, 16-aligned, and no longer in use.
                unsafe { *block.cast::<*mut u8>() = *head };
                *head = block;
                *count += 1;
                return;
            }
        }
        if let Some(l) = class_layout(c) {
            // SAFETY: every block of class `c` came from `System` with this layout.
            unsafe { System.dealloc(block, l) };
        }
    }

    #[inline(never)]
    unsafe fn realloc(&self, block: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let (old, new) = (class(layout.size(), layout.align()), class(new_size, layout.align()));
        match (old, new) {
            // Neither is cached: dlmalloc may grow or shrink in place.
            // SAFETY: forwarded as given.
            (None, None) => unsafe { System.realloc(block, layout, new_size) },
            // The block's class already holds the new size.
            (Some(a), Some(b)) if a == b => block,
            _ => {
                // SAFETY: `new_size` is non-zero and, rounded to the alignment, does not
                // overflow (the caller's contract for `realloc`).
                let new_layout = unsafe { Layout::from_size_align_unchecked(new_size, layout.align()) };
                // SAFETY: a valid layout; the old block is live for `layout.size()` bytes.
                unsafe {
                    let moved = self.alloc(new_layout);
                    if !moved.is_null() {
                        ptr::copy_nonoverlapping(block, moved, layout.size().min(new_size));
                        self.dealloc(block, layout);
                    }
                    moved
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes_cover_every_small_size_once() {
        assert_eq!(class(1, 1), Some(0));
        assert_eq!(class(16, 8), Some(0));
        assert_eq!(class(17, 1), Some(1));
        assert_eq!(class(256, 16), Some(4));
        assert_eq!(class(257, 1), None);
        assert_eq!(class(8, 32), None);
        for size in 1..=MAX_SIZE {
            let c = class(size, 8).unwrap_or(usize::MAX);
            assert!(c < CLASSES && size <= 16 << c && (c == 0 || size > 8 << c), "{size}");
        }
    }

    #[test]
    fn blocks_are_reused_and_the_lists_stay_bounded() {
        let a = CachedAlloc::new();
        let l = Layout::from_size_align(40, 8).unwrap_or(Layout::new::<u8>());
        // SAFETY: each block is written within its size and freed once with its layout.
        unsafe {
            let p = a.alloc(l);
            assert!(!p.is_null() && (p as usize).is_multiple_of(ALIGN));
            p.write_bytes(7, 40);
            a.dealloc(p, l);
            let q = a.alloc(l);
            assert_eq!(p, q, "a freed block is handed out again");
            let grown = a.realloc(q, l, 60);
            assert_eq!(grown, q, "same class: grown in place");
            let moved = a.realloc(grown, Layout::from_size_align(60, 8).unwrap_or(l), 1000);
            assert!(!moved.is_null());
            assert_eq!(*moved.add(39), 7);
            System.dealloc(moved, Layout::from_size_align(1000, 8).unwrap_or(l));
            let blocks: Vec<*mut u8> = (0..200).map(|_| a.alloc(l)).collect();
            for b in blocks {
                a.dealloc(b, l);
            }
            assert_eq!((*a.0.get()).count[class(40, 8).unwrap_or(0)], KEEP);
        }
    }
}
