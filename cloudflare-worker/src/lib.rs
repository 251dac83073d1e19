//! `ratewall-worker`: ratewall as a Cloudflare Worker — each rate-limit key a Durable
//! Object, plus the global store (`POST /v1/sync`) that filter fleets sync to.
//!
//! Not built yet (issue 5): this crate is a placeholder so the workspace has the layout of
//! DESIGN.md. It holds no Worker code and nothing here is claimed to work.
#![no_std]
