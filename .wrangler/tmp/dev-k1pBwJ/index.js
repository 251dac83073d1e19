var __defProp = Object.defineProperty;
var __name = (target, value) => __defProp(target, "name", { value, configurable: true });

// dist/worker/index.js
import { WorkerEntrypoint as Ie } from "cloudflare:workers";
import Y from "./ecae2e665f271fd0822c2bec4e7aa8595ad470b3-index_bg.wasm";
var H = globalThis.__worker_init_state = { criticalError: false, instanceId: 0 };
var x = class {
  static {
    __name(this, "x");
  }
  __destroy_into_raw() {
    let e = this.__wbg_ptr;
    return this.__wbg_ptr = 0, be.unregister(this), e;
  }
  free() {
    let e = this.__destroy_into_raw();
    c();
    try {
      i.__wbg_containerstartupoptions_free(e, 0);
    } catch (t) {
      s(t);
    }
  }
  get enableInternet() {
    if (this.__wbg_inst !== void 0 && this.__wbg_inst !== o) throw new Error("Invalid stale object from previous Wasm instance");
    let e;
    c();
    try {
      e = i.__wbg_get_containerstartupoptions_enableInternet(this.__wbg_ptr);
    } catch (t) {
      s(t);
    }
    return e === 16777215 ? void 0 : e !== 0;
  }
  get entrypoint() {
    if (this.__wbg_inst !== void 0 && this.__wbg_inst !== o) throw new Error("Invalid stale object from previous Wasm instance");
    let e;
    c();
    try {
      e = i.__wbg_get_containerstartupoptions_entrypoint(this.__wbg_ptr);
    } catch (n) {
      s(n);
    }
    var t = he(e[0], e[1]);
    return i.__wbindgen_free(e[0], e[1] * 4, 4), t;
  }
  get env() {
    if (this.__wbg_inst !== void 0 && this.__wbg_inst !== o) throw new Error("Invalid stale object from previous Wasm instance");
    let e;
    c();
    try {
      e = i.__wbg_get_containerstartupoptions_env(this.__wbg_ptr);
    } catch (t) {
      s(t);
    }
    return e;
  }
  set enableInternet(e) {
    if (this.__wbg_inst !== void 0 && this.__wbg_inst !== o) throw new Error("Invalid stale object from previous Wasm instance");
    c();
    try {
      i.__wbg_set_containerstartupoptions_enableInternet(this.__wbg_ptr, u(e) ? 16777215 : e ? 1 : 0);
    } catch (t) {
      s(t);
    }
  }
  set entrypoint(e) {
    if (this.__wbg_inst !== void 0 && this.__wbg_inst !== o) throw new Error("Invalid stale object from previous Wasm instance");
    let t = pe(e, i.__wbindgen_malloc), n = h;
    c();
    try {
      i.__wbg_set_containerstartupoptions_entrypoint(this.__wbg_ptr, t, n);
    } catch (_) {
      s(_);
    }
  }
  set env(e) {
    if (this.__wbg_inst !== void 0 && this.__wbg_inst !== o) throw new Error("Invalid stale object from previous Wasm instance");
    c();
    try {
      i.__wbg_set_containerstartupoptions_env(this.__wbg_ptr, e);
    } catch (t) {
      s(t);
    }
  }
};
Symbol.dispose && (x.prototype[Symbol.dispose] = x.prototype.free);
var z = class {
  static {
    __name(this, "z");
  }
  __destroy_into_raw() {
    let e = this.__wbg_ptr;
    return this.__wbg_ptr = 0, de.unregister(this), e;
  }
  free() {
    let e = this.__destroy_into_raw();
    c();
    try {
      i.__wbg_intounderlyingbytesource_free(e, 0);
    } catch (t) {
      s(t);
    }
  }
  get autoAllocateChunkSize() {
    if (this.__wbg_inst !== void 0 && this.__wbg_inst !== o) throw new Error("Invalid stale object from previous Wasm instance");
    let e;
    c();
    try {
      e = i.intounderlyingbytesource_autoAllocateChunkSize(this.__wbg_ptr);
    } catch (t) {
      s(t);
    }
    return e >>> 0;
  }
  cancel() {
    if (this.__wbg_inst !== void 0 && this.__wbg_inst !== o) throw new Error("Invalid stale object from previous Wasm instance");
    let e = this.__destroy_into_raw();
    c();
    try {
      i.intounderlyingbytesource_cancel(e);
    } catch (t) {
      s(t);
    }
  }
  pull(e) {
    if (this.__wbg_inst !== void 0 && this.__wbg_inst !== o) throw new Error("Invalid stale object from previous Wasm instance");
    let t;
    c();
    try {
      t = i.intounderlyingbytesource_pull(this.__wbg_ptr, e);
    } catch (n) {
      s(n);
    }
    return t;
  }
  start(e) {
    if (this.__wbg_inst !== void 0 && this.__wbg_inst !== o) throw new Error("Invalid stale object from previous Wasm instance");
    c();
    try {
      i.intounderlyingbytesource_start(this.__wbg_ptr, e);
    } catch (t) {
      s(t);
    }
  }
  get type() {
    if (this.__wbg_inst !== void 0 && this.__wbg_inst !== o) throw new Error("Invalid stale object from previous Wasm instance");
    let e;
    c();
    try {
      e = i.intounderlyingbytesource_type(this.__wbg_ptr);
    } catch (t) {
      s(t);
    }
    return ae[e];
  }
};
Symbol.dispose && (z.prototype[Symbol.dispose] = z.prototype.free);
var O = class {
  static {
    __name(this, "O");
  }
  __destroy_into_raw() {
    let e = this.__wbg_ptr;
    return this.__wbg_ptr = 0, we.unregister(this), e;
  }
  free() {
    let e = this.__destroy_into_raw();
    c();
    try {
      i.__wbg_intounderlyingsink_free(e, 0);
    } catch (t) {
      s(t);
    }
  }
  abort(e) {
    if (this.__wbg_inst !== void 0 && this.__wbg_inst !== o) throw new Error("Invalid stale object from previous Wasm instance");
    let t = this.__destroy_into_raw(), n;
    c();
    try {
      n = i.intounderlyingsink_abort(t, e);
    } catch (_) {
      s(_);
    }
    return n;
  }
  close() {
    if (this.__wbg_inst !== void 0 && this.__wbg_inst !== o) throw new Error("Invalid stale object from previous Wasm instance");
    let e = this.__destroy_into_raw(), t;
    c();
    try {
      t = i.intounderlyingsink_close(e);
    } catch (n) {
      s(n);
    }
    return t;
  }
  write(e) {
    if (this.__wbg_inst !== void 0 && this.__wbg_inst !== o) throw new Error("Invalid stale object from previous Wasm instance");
    let t;
    c();
    try {
      t = i.intounderlyingsink_write(this.__wbg_ptr, e);
    } catch (n) {
      s(n);
    }
    return t;
  }
};
Symbol.dispose && (O.prototype[Symbol.dispose] = O.prototype.free);
var P = class {
  static {
    __name(this, "P");
  }
  __destroy_into_raw() {
    let e = this.__wbg_ptr;
    return this.__wbg_ptr = 0, ge.unregister(this), e;
  }
  free() {
    let e = this.__destroy_into_raw();
    c();
    try {
      i.__wbg_intounderlyingsource_free(e, 0);
    } catch (t) {
      s(t);
    }
  }
  cancel() {
    if (this.__wbg_inst !== void 0 && this.__wbg_inst !== o) throw new Error("Invalid stale object from previous Wasm instance");
    let e = this.__destroy_into_raw();
    c();
    try {
      i.intounderlyingsource_cancel(e);
    } catch (t) {
      s(t);
    }
  }
  pull(e) {
    if (this.__wbg_inst !== void 0 && this.__wbg_inst !== o) throw new Error("Invalid stale object from previous Wasm instance");
    let t;
    c();
    try {
      t = i.intounderlyingsource_pull(this.__wbg_ptr, e);
    } catch (n) {
      s(n);
    }
    return t;
  }
};
Symbol.dispose && (P.prototype[Symbol.dispose] = P.prototype.free);
var v = class r {
  static {
    __name(this, "r");
  }
  static __wrap(e) {
    let t = Object.create(r.prototype);
    return t.__wbg_ptr = e, Object.defineProperty(t, "__wbg_inst", { value: o, writable: true }), G.register(t, { ptr: e, instance: o }, t), t;
  }
  __destroy_into_raw() {
    let e = this.__wbg_ptr;
    return this.__wbg_ptr = 0, G.unregister(this), e;
  }
  free() {
    let e = this.__destroy_into_raw();
    c();
    try {
      i.__wbg_minifyconfig_free(e, 0);
    } catch (t) {
      s(t);
    }
  }
  get css() {
    if (this.__wbg_inst !== void 0 && this.__wbg_inst !== o) throw new Error("Invalid stale object from previous Wasm instance");
    let e;
    c();
    try {
      e = i.__wbg_get_minifyconfig_css(this.__wbg_ptr);
    } catch (t) {
      s(t);
    }
    return e !== 0;
  }
  get html() {
    if (this.__wbg_inst !== void 0 && this.__wbg_inst !== o) throw new Error("Invalid stale object from previous Wasm instance");
    let e;
    c();
    try {
      e = i.__wbg_get_minifyconfig_html(this.__wbg_ptr);
    } catch (t) {
      s(t);
    }
    return e !== 0;
  }
  get js() {
    if (this.__wbg_inst !== void 0 && this.__wbg_inst !== o) throw new Error("Invalid stale object from previous Wasm instance");
    let e;
    c();
    try {
      e = i.__wbg_get_minifyconfig_js(this.__wbg_ptr);
    } catch (t) {
      s(t);
    }
    return e !== 0;
  }
  set css(e) {
    if (this.__wbg_inst !== void 0 && this.__wbg_inst !== o) throw new Error("Invalid stale object from previous Wasm instance");
    c();
    try {
      i.__wbg_set_minifyconfig_css(this.__wbg_ptr, e);
    } catch (t) {
      s(t);
    }
  }
  set html(e) {
    if (this.__wbg_inst !== void 0 && this.__wbg_inst !== o) throw new Error("Invalid stale object from previous Wasm instance");
    c();
    try {
      i.__wbg_set_minifyconfig_html(this.__wbg_ptr, e);
    } catch (t) {
      s(t);
    }
  }
  set js(e) {
    if (this.__wbg_inst !== void 0 && this.__wbg_inst !== o) throw new Error("Invalid stale object from previous Wasm instance");
    c();
    try {
      i.__wbg_set_minifyconfig_js(this.__wbg_ptr, e);
    } catch (t) {
      s(t);
    }
  }
};
Symbol.dispose && (v.prototype[Symbol.dispose] = v.prototype.free);
var E = class {
  static {
    __name(this, "E");
  }
  __destroy_into_raw() {
    let e = this.__wbg_ptr;
    return this.__wbg_ptr = 0, le.unregister(this), e;
  }
  free() {
    let e = this.__destroy_into_raw();
    c();
    try {
      i.__wbg_r2range_free(e, 0);
    } catch (t) {
      s(t);
    }
  }
  get length() {
    if (this.__wbg_inst !== void 0 && this.__wbg_inst !== o) throw new Error("Invalid stale object from previous Wasm instance");
    let e;
    c();
    try {
      e = i.__wbg_get_r2range_length(this.__wbg_ptr);
    } catch (t) {
      s(t);
    }
    return e[0] === 0 ? void 0 : e[1];
  }
  get offset() {
    if (this.__wbg_inst !== void 0 && this.__wbg_inst !== o) throw new Error("Invalid stale object from previous Wasm instance");
    let e;
    c();
    try {
      e = i.__wbg_get_r2range_offset(this.__wbg_ptr);
    } catch (t) {
      s(t);
    }
    return e[0] === 0 ? void 0 : e[1];
  }
  get suffix() {
    if (this.__wbg_inst !== void 0 && this.__wbg_inst !== o) throw new Error("Invalid stale object from previous Wasm instance");
    let e;
    c();
    try {
      e = i.__wbg_get_r2range_suffix(this.__wbg_ptr);
    } catch (t) {
      s(t);
    }
    return e[0] === 0 ? void 0 : e[1];
  }
  set length(e) {
    if (this.__wbg_inst !== void 0 && this.__wbg_inst !== o) throw new Error("Invalid stale object from previous Wasm instance");
    c();
    try {
      i.__wbg_set_r2range_length(this.__wbg_ptr, !u(e), u(e) ? 0 : e);
    } catch (t) {
      s(t);
    }
  }
  set offset(e) {
    if (this.__wbg_inst !== void 0 && this.__wbg_inst !== o) throw new Error("Invalid stale object from previous Wasm instance");
    c();
    try {
      i.__wbg_set_r2range_offset(this.__wbg_ptr, !u(e), u(e) ? 0 : e);
    } catch (t) {
      s(t);
    }
  }
  set suffix(e) {
    if (this.__wbg_inst !== void 0 && this.__wbg_inst !== o) throw new Error("Invalid stale object from previous Wasm instance");
    c();
    try {
      i.__wbg_set_r2range_suffix(this.__wbg_ptr, !u(e), u(e) ? 0 : e);
    } catch (t) {
      s(t);
    }
  }
};
Symbol.dispose && (E.prototype[Symbol.dispose] = E.prototype.free);
var R = class {
  static {
    __name(this, "R");
  }
  __destroy_into_raw() {
    let e = this.__wbg_ptr;
    return this.__wbg_ptr = 0, K.unregister(this), e;
  }
  free() {
    let e = this.__destroy_into_raw();
    c();
    try {
      i.__wbg_ratelimitcounter_free(e, 0);
    } catch (t) {
      s(t);
    }
  }
  alarm() {
    if (this.__wbg_inst !== void 0 && this.__wbg_inst !== o) throw new Error("Invalid stale object from previous Wasm instance");
    let e;
    c();
    try {
      e = i.ratelimitcounter_alarm(this.__wbg_ptr);
    } catch (t) {
      s(t);
    }
    return e;
  }
  connect(e) {
    if (this.__wbg_inst !== void 0 && this.__wbg_inst !== o) throw new Error("Invalid stale object from previous Wasm instance");
    let t;
    c();
    try {
      t = i.ratelimitcounter_connect(this.__wbg_ptr, e);
    } catch (n) {
      s(n);
    }
    return t;
  }
  fetch(e) {
    if (this.__wbg_inst !== void 0 && this.__wbg_inst !== o) throw new Error("Invalid stale object from previous Wasm instance");
    let t;
    c();
    try {
      t = i.ratelimitcounter_fetch(this.__wbg_ptr, e);
    } catch (n) {
      s(n);
    }
    return t;
  }
  constructor(e, t) {
    let n;
    c();
    try {
      n = i.ratelimitcounter_new(e, t);
    } catch (_) {
      s(_);
    }
    return this.__wbg_ptr = n, Object.defineProperty(this, "__wbg_inst", { value: o, writable: true }), K.register(this, { ptr: n, instance: o }, this), this;
  }
  webSocketClose(e, t, n, _) {
    if (this.__wbg_inst !== void 0 && this.__wbg_inst !== o) throw new Error("Invalid stale object from previous Wasm instance");
    let a = +t, f = +_, b = m(n, i.__wbindgen_malloc, i.__wbindgen_realloc), g = h, I;
    c();
    try {
      I = i.ratelimitcounter_webSocketClose(this.__wbg_ptr, e, a, b, g, f);
    } catch (F) {
      s(F);
    }
    return I;
  }
  webSocketError(e, t) {
    if (this.__wbg_inst !== void 0 && this.__wbg_inst !== o) throw new Error("Invalid stale object from previous Wasm instance");
    let n;
    c();
    try {
      n = i.ratelimitcounter_webSocketError(this.__wbg_ptr, e, t);
    } catch (_) {
      s(_);
    }
    return n;
  }
  webSocketMessage(e, t) {
    if (this.__wbg_inst !== void 0 && this.__wbg_inst !== o) throw new Error("Invalid stale object from previous Wasm instance");
    let n;
    c();
    try {
      n = i.ratelimitcounter_webSocketMessage(this.__wbg_ptr, e, t);
    } catch (_) {
      s(_);
    }
    return n;
  }
};
Symbol.dispose && (R.prototype[Symbol.dispose] = R.prototype.free);
function M() {
  o++, y = null, W = null, S = null, typeof numBytesDecoded < "u" && (numBytesDecoded = 0), typeof h < "u" && (h = 0), N = false, C = false, B = new WebAssembly.Instance(Y, te()), i = B.exports, i.__wbindgen_start();
}
__name(M, "M");
function Z() {
  let r2;
  c();
  try {
    r2 = i.__worker_init_state();
  } catch (e) {
    s(e);
  }
  return r2;
}
__name(Z, "Z");
function ee(r2, e, t) {
  let n;
  c();
  try {
    n = i.fetch(r2, e, t);
  } catch (_) {
    s(_);
  }
  return n;
}
__name(ee, "ee");
function te() {
  return { __proto__: null, "./index_bg.js": { __proto__: null, __wbg_Error_208446807d0d1e30: /* @__PURE__ */ __name(function(e, t) {
    return Error(d(e, t));
  }, "__wbg_Error_208446807d0d1e30"), __wbg_String_8564e559799eccda: /* @__PURE__ */ __name(function(e, t) {
    let n = String(t), _ = m(n, i.__wbindgen_malloc, i.__wbindgen_realloc), a = h;
    w().setInt32((e >>> 0) + 4, a, true), w().setInt32((e >>> 0) + 0, _, true);
  }, "__wbg_String_8564e559799eccda"), __wbg___wbindgen_boolean_get_4f1baf9a00be3c74: /* @__PURE__ */ __name(function(e) {
    let t = e, n = typeof t == "boolean" ? t : void 0;
    return u(n) ? 16777215 : n ? 1 : 0;
  }, "__wbg___wbindgen_boolean_get_4f1baf9a00be3c74"), __wbg___wbindgen_debug_string_f249a2a76caa9a55: /* @__PURE__ */ __name(function(e, t) {
    let n = re(t), _ = m(n, i.__wbindgen_malloc, i.__wbindgen_realloc), a = h;
    w().setInt32((e >>> 0) + 4, a, true), w().setInt32((e >>> 0) + 0, _, true);
  }, "__wbg___wbindgen_debug_string_f249a2a76caa9a55"), __wbg___wbindgen_is_function_741ff2bb612836f5: /* @__PURE__ */ __name(function(e) {
    return typeof e == "function";
  }, "__wbg___wbindgen_is_function_741ff2bb612836f5"), __wbg___wbindgen_is_null_or_undefined_fb96af93c75460ae: /* @__PURE__ */ __name(function(e) {
    return e == null;
  }, "__wbg___wbindgen_is_null_or_undefined_fb96af93c75460ae"), __wbg___wbindgen_is_string_fc456fee5d3317de: /* @__PURE__ */ __name(function(e) {
    return typeof e == "string";
  }, "__wbg___wbindgen_is_string_fc456fee5d3317de"), __wbg___wbindgen_is_undefined_be5b34249ff1fc15: /* @__PURE__ */ __name(function(e) {
    return e === void 0;
  }, "__wbg___wbindgen_is_undefined_be5b34249ff1fc15"), __wbg___wbindgen_jsval_loose_eq_b2f214e2e4b30e36: /* @__PURE__ */ __name(function(e, t) {
    return e == t;
  }, "__wbg___wbindgen_jsval_loose_eq_b2f214e2e4b30e36"), __wbg___wbindgen_number_get_934b640d0889af78: /* @__PURE__ */ __name(function(e, t) {
    let n = t, _ = typeof n == "number" ? n : void 0;
    w().setFloat64((e >>> 0) + 8, u(_) ? 0 : _, true), w().setInt32((e >>> 0) + 0, !u(_), true);
  }, "__wbg___wbindgen_number_get_934b640d0889af78"), __wbg___wbindgen_reinit_2fe0d0b9c1cc3c21: /* @__PURE__ */ __name(function() {
    C = true;
  }, "__wbg___wbindgen_reinit_2fe0d0b9c1cc3c21"), __wbg___wbindgen_string_get_7ce8eee7fd327545: /* @__PURE__ */ __name(function(e, t) {
    let n = t, _ = typeof n == "string" ? n : void 0;
    var a = u(_) ? 0 : m(_, i.__wbindgen_malloc, i.__wbindgen_realloc), f = h;
    w().setInt32((e >>> 0) + 4, f, true), w().setInt32((e >>> 0) + 0, a, true);
  }, "__wbg___wbindgen_string_get_7ce8eee7fd327545"), __wbg___wbindgen_throw_4c88d8bf264fd984: /* @__PURE__ */ __name(function(e, t) {
    throw new WebAssembly.Exception(D, [new Error(d(e, t))]);
  }, "__wbg___wbindgen_throw_4c88d8bf264fd984"), __wbg__wbg_cb_unref_09736879a3f67559: /* @__PURE__ */ __name(function(e) {
    e._wbg_cb_unref();
  }, "__wbg__wbg_cb_unref_09736879a3f67559"), __wbg_append_ba9a4dc30a0323fd: /* @__PURE__ */ __name(function(e, t, n, _, a) {
    e.append(d(t, n), d(_, a));
  }, "__wbg_append_ba9a4dc30a0323fd"), __wbg_arrayBuffer_39a766224696fd9d: /* @__PURE__ */ __name(function(e) {
    return e.arrayBuffer();
  }, "__wbg_arrayBuffer_39a766224696fd9d"), __wbg_body_0da01a9a056907d8: /* @__PURE__ */ __name(function(e) {
    let t = e.body;
    return u(t) ? 0 : l(t);
  }, "__wbg_body_0da01a9a056907d8"), __wbg_body_b86ad4fe78cc379c: /* @__PURE__ */ __name(function(e) {
    let t = e.body;
    return u(t) ? 0 : l(t);
  }, "__wbg_body_b86ad4fe78cc379c"), __wbg_buffer_aca05a93c046db1a: /* @__PURE__ */ __name(function(e) {
    return e.buffer;
  }, "__wbg_buffer_aca05a93c046db1a"), __wbg_byobRequest_18280c78e462544c: /* @__PURE__ */ __name(function(e) {
    let t = e.byobRequest;
    return u(t) ? 0 : l(t);
  }, "__wbg_byobRequest_18280c78e462544c"), __wbg_byteLength_c5f3c188d5252e5b: /* @__PURE__ */ __name(function(e) {
    return e.byteLength;
  }, "__wbg_byteLength_c5f3c188d5252e5b"), __wbg_byteOffset_63cdc7b38f33a45e: /* @__PURE__ */ __name(function(e) {
    return e.byteOffset;
  }, "__wbg_byteOffset_63cdc7b38f33a45e"), __wbg_call_a410eb4b59ed5965: /* @__PURE__ */ __name(function(e, t, n) {
    return e.call(t, n);
  }, "__wbg_call_a410eb4b59ed5965"), __wbg_call_fc92fee6137d452d: /* @__PURE__ */ __name(function(e, t, n, _) {
    return e.call(t, n, _);
  }, "__wbg_call_fc92fee6137d452d"), __wbg_cancel_b195250778e9d8e7: /* @__PURE__ */ __name(function(e) {
    return e.cancel();
  }, "__wbg_cancel_b195250778e9d8e7"), __wbg_catch_fd4c7ea14fde9d83: /* @__PURE__ */ __name(function(e, t) {
    return e.catch(t);
  }, "__wbg_catch_fd4c7ea14fde9d83"), __wbg_cause_4cdda1b55a30b227: /* @__PURE__ */ __name(function(e) {
    return e.cause;
  }, "__wbg_cause_4cdda1b55a30b227"), __wbg_cf_3eef96d446a499c0: /* @__PURE__ */ __name(function(e) {
    let t = e.cf;
    return u(t) ? 0 : l(t);
  }, "__wbg_cf_3eef96d446a499c0"), __wbg_cf_e4bf1d08e9961dec: /* @__PURE__ */ __name(function(e) {
    let t = e.cf;
    return u(t) ? 0 : l(t);
  }, "__wbg_cf_e4bf1d08e9961dec"), __wbg_clearTimeout_d859c3fbfd863ce7: /* @__PURE__ */ __name(function(e, t) {
    e.clearTimeout(t);
  }, "__wbg_clearTimeout_d859c3fbfd863ce7"), __wbg_close_294d3f727cb7a844: /* @__PURE__ */ __name(function(e) {
    e.close();
  }, "__wbg_close_294d3f727cb7a844"), __wbg_close_bf94aa7e38b9a94b: /* @__PURE__ */ __name(function(e) {
    e.close();
  }, "__wbg_close_bf94aa7e38b9a94b"), __wbg_constructor_76ad3e2c50d259de: /* @__PURE__ */ __name(function(e) {
    return e.constructor;
  }, "__wbg_constructor_76ad3e2c50d259de"), __wbg_deleteAll_e9ef46621cab9eee: /* @__PURE__ */ __name(function(e) {
    return e.deleteAll();
  }, "__wbg_deleteAll_e9ef46621cab9eee"), __wbg_done_57e08d0be6e30c02: /* @__PURE__ */ __name(function(e) {
    return e.done;
  }, "__wbg_done_57e08d0be6e30c02"), __wbg_enqueue_c11626eae1c54509: /* @__PURE__ */ __name(function(e, t) {
    e.enqueue(t);
  }, "__wbg_enqueue_c11626eae1c54509"), __wbg_entries_fb0b3ba27a6e0bf7: /* @__PURE__ */ __name(function(e) {
    return e.entries();
  }, "__wbg_entries_fb0b3ba27a6e0bf7"), __wbg_error_9b95f63d905893d2: /* @__PURE__ */ __name(function(e, t) {
    console.error(e, t);
  }, "__wbg_error_9b95f63d905893d2"), __wbg_error_d1fc0193610e0e39: /* @__PURE__ */ __name(function(e) {
    console.error(e);
  }, "__wbg_error_d1fc0193610e0e39"), __wbg_fetch_5062478af0882fcd: /* @__PURE__ */ __name(function(e, t) {
    return e.fetch(t);
  }, "__wbg_fetch_5062478af0882fcd"), __wbg_fetch_58e62838507dad34: /* @__PURE__ */ __name(function(e, t) {
    return e.fetch(t);
  }, "__wbg_fetch_58e62838507dad34"), __wbg_fetch_8991a6a8ea67c83b: /* @__PURE__ */ __name(function(e, t, n, _) {
    return e.fetch(d(t, n), _);
  }, "__wbg_fetch_8991a6a8ea67c83b"), __wbg_fetch_a416b432a33cc077: /* @__PURE__ */ __name(function(e, t, n) {
    return e.fetch(t, n);
  }, "__wbg_fetch_a416b432a33cc077"), __wbg_getByName_54117a7a05bfab4a: /* @__PURE__ */ __name(function(e, t, n) {
    return e.getByName(d(t, n));
  }, "__wbg_getByName_54117a7a05bfab4a"), __wbg_getReader_3b3096cf504fce5e: /* @__PURE__ */ __name(function(e) {
    return e.getReader();
  }, "__wbg_getReader_3b3096cf504fce5e"), __wbg_getTime_edc91481cbc4cd78: /* @__PURE__ */ __name(function(e) {
    return e.getTime();
  }, "__wbg_getTime_edc91481cbc4cd78"), __wbg_get_0ae635d02d232017: /* @__PURE__ */ __name(function(e, t) {
    let n = Reflect.get(e, t);
    return u(n) ? 0 : l(n);
  }, "__wbg_get_0ae635d02d232017"), __wbg_get_2080c49015e35254: /* @__PURE__ */ __name(function(e, t) {
    return Reflect.get(e, t);
  }, "__wbg_get_2080c49015e35254"), __wbg_get_556f1c9a5c587e8c: /* @__PURE__ */ __name(function(e, t, n, _) {
    let a = t.get(d(n, _));
    var f = u(a) ? 0 : m(a, i.__wbindgen_malloc, i.__wbindgen_realloc), b = h;
    w().setInt32((e >>> 0) + 4, b, true), w().setInt32((e >>> 0) + 0, f, true);
  }, "__wbg_get_556f1c9a5c587e8c"), __wbg_get_d50e09af39626749: /* @__PURE__ */ __name(function(e, t, n) {
    return e.get(d(t, n));
  }, "__wbg_get_d50e09af39626749"), __wbg_get_d7176cfb76d71114: /* @__PURE__ */ __name(function(e, t) {
    return e[t >>> 0];
  }, "__wbg_get_d7176cfb76d71114"), __wbg_get_done_3bf2b4a34e149301: /* @__PURE__ */ __name(function(e) {
    let t = e.done;
    return u(t) ? 16777215 : t ? 1 : 0;
  }, "__wbg_get_done_3bf2b4a34e149301"), __wbg_get_value_9454480da7066d61: /* @__PURE__ */ __name(function(e) {
    return e.value;
  }, "__wbg_get_value_9454480da7066d61"), __wbg_headers_5fc0106c076eb731: /* @__PURE__ */ __name(function(e) {
    return e.headers;
  }, "__wbg_headers_5fc0106c076eb731"), __wbg_headers_9ef80dd266706f48: /* @__PURE__ */ __name(function(e) {
    return e.headers;
  }, "__wbg_headers_9ef80dd266706f48"), __wbg_instanceId_65a51bedfd10160a: /* @__PURE__ */ __name(function(e) {
    return e.instanceId;
  }, "__wbg_instanceId_65a51bedfd10160a"), __wbg_instanceof_ArrayBuffer_12cdaa4161423e6b: /* @__PURE__ */ __name(function(e) {
    let t;
    try {
      t = e instanceof ArrayBuffer;
    } catch {
      t = false;
    }
    return t;
  }, "__wbg_instanceof_ArrayBuffer_12cdaa4161423e6b"), __wbg_instanceof_Error_74e3cca0c4a69161: /* @__PURE__ */ __name(function(e) {
    let t;
    try {
      t = e instanceof Error;
    } catch {
      t = false;
    }
    return t;
  }, "__wbg_instanceof_Error_74e3cca0c4a69161"), __wbg_instanceof_ReadableStream_ac28304925ec0f96: /* @__PURE__ */ __name(function(e) {
    let t;
    try {
      t = e instanceof ReadableStream;
    } catch {
      t = false;
    }
    return t;
  }, "__wbg_instanceof_ReadableStream_ac28304925ec0f96"), __wbg_instanceof_Response_5b0b4f7f1daeae51: /* @__PURE__ */ __name(function(e) {
    let t;
    try {
      t = e instanceof Response;
    } catch {
      t = false;
    }
    return t;
  }, "__wbg_instanceof_Response_5b0b4f7f1daeae51"), __wbg_instanceof_Uint8Array_d7aeb0dcb3108fea: /* @__PURE__ */ __name(function(e) {
    let t;
    try {
      t = e instanceof Uint8Array;
    } catch {
      t = false;
    }
    return t;
  }, "__wbg_instanceof_Uint8Array_d7aeb0dcb3108fea"), __wbg_keys_296846770c088f87: /* @__PURE__ */ __name(function(e) {
    return e.keys();
  }, "__wbg_keys_296846770c088f87"), __wbg_length_186163212ffe79c3: /* @__PURE__ */ __name(function(e) {
    return e.length;
  }, "__wbg_length_186163212ffe79c3"), __wbg_log_ff86bbb34c295e21: /* @__PURE__ */ __name(function(e) {
    console.log(e);
  }, "__wbg_log_ff86bbb34c295e21"), __wbg_message_43d8c8f1d543a349: /* @__PURE__ */ __name(function(e) {
    return e.message;
  }, "__wbg_message_43d8c8f1d543a349"), __wbg_method_3d406ebab4dd9853: /* @__PURE__ */ __name(function(e, t) {
    let n = t.method, _ = m(n, i.__wbindgen_malloc, i.__wbindgen_realloc), a = h;
    w().setInt32((e >>> 0) + 4, a, true), w().setInt32((e >>> 0) + 0, _, true);
  }, "__wbg_method_3d406ebab4dd9853"), __wbg_minifyconfig_new: /* @__PURE__ */ __name(function(e) {
    return v.__wrap(e);
  }, "__wbg_minifyconfig_new"), __wbg_name_d1fa514fdca6a975: /* @__PURE__ */ __name(function(e) {
    return e.name;
  }, "__wbg_name_d1fa514fdca6a975"), __wbg_name_fd11f69c917c5670: /* @__PURE__ */ __name(function(e) {
    return e.name;
  }, "__wbg_name_fd11f69c917c5670"), __wbg_new_0_36d738a0c8cfac43: /* @__PURE__ */ __name(function() {
    return /* @__PURE__ */ new Date();
  }, "__wbg_new_0_36d738a0c8cfac43"), __wbg_new_13de428334042d26: /* @__PURE__ */ __name(function(e) {
    return new Uint8Array(e);
  }, "__wbg_new_13de428334042d26"), __wbg_new_277c27c26f94cbc2: /* @__PURE__ */ __name(function() {
    return new Headers();
  }, "__wbg_new_277c27c26f94cbc2"), __wbg_new_3e95cd7386bb9a6c: /* @__PURE__ */ __name(function(e) {
    return new Date(e);
  }, "__wbg_new_3e95cd7386bb9a6c"), __wbg_new_7075786089b89c5e: /* @__PURE__ */ __name(function() {
    return /* @__PURE__ */ new Map();
  }, "__wbg_new_7075786089b89c5e"), __wbg_new_787b9fb330d55d78: /* @__PURE__ */ __name(function(e, t) {
    return new Error(d(e, t));
  }, "__wbg_new_787b9fb330d55d78"), __wbg_new_cd4348290afae586: /* @__PURE__ */ __name(function() {
    return new Object();
  }, "__wbg_new_cd4348290afae586"), __wbg_new_typed_e09da9dae6ee5935: /* @__PURE__ */ __name(function(e, t) {
    try {
      var n = { a: e, b: t }, _ = /* @__PURE__ */ __name((f, b) => {
        let g = n.a;
        n.a = 0;
        try {
          return ce(g, n.b, f, b);
        } finally {
          n.a = g;
        }
      }, "_");
      return new Promise(_);
    } finally {
      n.a = 0;
    }
  }, "__wbg_new_typed_e09da9dae6ee5935"), __wbg_new_with_byte_offset_and_length_3cd32055a417f095: /* @__PURE__ */ __name(function(e, t, n) {
    return new Uint8Array(e, t >>> 0, n >>> 0);
  }, "__wbg_new_with_byte_offset_and_length_3cd32055a417f095"), __wbg_new_with_length_01b143a7e5dd5a3e: /* @__PURE__ */ __name(function(e) {
    return new Uint8Array(e >>> 0);
  }, "__wbg_new_with_length_01b143a7e5dd5a3e"), __wbg_new_with_opt_buffer_source_and_init_efb63b64b37a12c7: /* @__PURE__ */ __name(function(e, t) {
    return new Response(e, t);
  }, "__wbg_new_with_opt_buffer_source_and_init_efb63b64b37a12c7"), __wbg_new_with_opt_readable_stream_and_init_383c64eccf9e9cc7: /* @__PURE__ */ __name(function(e, t) {
    return new Response(e, t);
  }, "__wbg_new_with_opt_readable_stream_and_init_383c64eccf9e9cc7"), __wbg_new_with_opt_str_and_init_6456bed24baae6fc: /* @__PURE__ */ __name(function(e, t, n) {
    return new Response(e === 0 ? void 0 : d(e, t), n);
  }, "__wbg_new_with_opt_str_and_init_6456bed24baae6fc"), __wbg_new_with_str_and_init_d9f6b5611184e16b: /* @__PURE__ */ __name(function(e, t, n) {
    return new Request(d(e, t), n);
  }, "__wbg_new_with_str_and_init_d9f6b5611184e16b"), __wbg_next_af5ac6a08bb0a717: /* @__PURE__ */ __name(function(e) {
    return e.next();
  }, "__wbg_next_af5ac6a08bb0a717"), __wbg_prototypesetcall_13162965d1fe7aa3: /* @__PURE__ */ __name(function(e, t, n) {
    Uint8Array.prototype.set.call(X(e, t), n);
  }, "__wbg_prototypesetcall_13162965d1fe7aa3"), __wbg_put_e23699e64023d941: /* @__PURE__ */ __name(function(e, t, n, _) {
    return e.put(d(t, n), _);
  }, "__wbg_put_e23699e64023d941"), __wbg_queueMicrotask_1e8503a8a690f0a3: /* @__PURE__ */ __name(function(e) {
    return e.queueMicrotask;
  }, "__wbg_queueMicrotask_1e8503a8a690f0a3"), __wbg_queueMicrotask_4a1a4d8dd332373b: /* @__PURE__ */ __name(function(e) {
    queueMicrotask(e);
  }, "__wbg_queueMicrotask_4a1a4d8dd332373b"), __wbg_read_e3bea75dace70752: /* @__PURE__ */ __name(function(e) {
    return e.read();
  }, "__wbg_read_e3bea75dace70752"), __wbg_readable_11d72b62fcfdd1ec: /* @__PURE__ */ __name(function(e) {
    return e.readable;
  }, "__wbg_readable_11d72b62fcfdd1ec"), __wbg_releaseLock_eddf1401c763f0b9: /* @__PURE__ */ __name(function(e) {
    e.releaseLock();
  }, "__wbg_releaseLock_eddf1401c763f0b9"), __wbg_resolve_dbf78ab4942478b0: /* @__PURE__ */ __name(function(e) {
    return Promise.resolve(e);
  }, "__wbg_resolve_dbf78ab4942478b0"), __wbg_respond_d97c023ee981d1f5: /* @__PURE__ */ __name(function(e, t) {
    e.respond(t >>> 0);
  }, "__wbg_respond_d97c023ee981d1f5"), __wbg_setAlarm_039d09296f34bacd: /* @__PURE__ */ __name(function(e, t, n) {
    return e.setAlarm(t, n);
  }, "__wbg_setAlarm_039d09296f34bacd"), __wbg_setTimeout_7b54aa5f72cd7066: /* @__PURE__ */ __name(function(e, t, n) {
    return e.setTimeout(t, n);
  }, "__wbg_setTimeout_7b54aa5f72cd7066"), __wbg_set_2793479888329cb6: /* @__PURE__ */ __name(function(e, t, n) {
    return Reflect.set(e, t, n);
  }, "__wbg_set_2793479888329cb6"), __wbg_set_8282f7e0d2d01336: /* @__PURE__ */ __name(function(e, t, n) {
    return e.set(t, n);
  }, "__wbg_set_8282f7e0d2d01336"), __wbg_set_bcb0ec2400cfa22e: /* @__PURE__ */ __name(function(e, t, n, _, a) {
    e.set(d(t, n), d(_, a));
  }, "__wbg_set_bcb0ec2400cfa22e"), __wbg_set_body_877d5251e78ca815: /* @__PURE__ */ __name(function(e, t) {
    e.body = t;
  }, "__wbg_set_body_877d5251e78ca815"), __wbg_set_cache_7a23201e29cbd632: /* @__PURE__ */ __name(function(e, t) {
    e.cache = fe[t];
  }, "__wbg_set_cache_7a23201e29cbd632"), __wbg_set_criticalError_c30445da7038dbf2: /* @__PURE__ */ __name(function(e, t) {
    e.criticalError = t !== 0;
  }, "__wbg_set_criticalError_c30445da7038dbf2"), __wbg_set_e4b9a833d288759a: /* @__PURE__ */ __name(function(e, t, n) {
    e[t] = n;
  }, "__wbg_set_e4b9a833d288759a"), __wbg_set_feb3714f475485ba: /* @__PURE__ */ __name(function(e, t, n) {
    e.set(X(t, n));
  }, "__wbg_set_feb3714f475485ba"), __wbg_set_headers_07f10dbe49bc0e77: /* @__PURE__ */ __name(function(e, t) {
    e.headers = t;
  }, "__wbg_set_headers_07f10dbe49bc0e77"), __wbg_set_headers_6d75a7df4eb22716: /* @__PURE__ */ __name(function(e, t) {
    e.headers = t;
  }, "__wbg_set_headers_6d75a7df4eb22716"), __wbg_set_instanceId_6f5f77d81e249b49: /* @__PURE__ */ __name(function(e, t) {
    e.instanceId = t >>> 0;
  }, "__wbg_set_instanceId_6f5f77d81e249b49"), __wbg_set_method_639e69af35614d36: /* @__PURE__ */ __name(function(e, t, n) {
    e.method = d(t, n);
  }, "__wbg_set_method_639e69af35614d36"), __wbg_set_redirect_a95a432ab7d10765: /* @__PURE__ */ __name(function(e, t) {
    e.redirect = ue[t];
  }, "__wbg_set_redirect_a95a432ab7d10765"), __wbg_set_signal_0b2eee78907e5ba7: /* @__PURE__ */ __name(function(e, t) {
    e.signal = t;
  }, "__wbg_set_signal_0b2eee78907e5ba7"), __wbg_set_status_bd9dc81d1c17b108: /* @__PURE__ */ __name(function(e, t) {
    e.status = t;
  }, "__wbg_set_status_bd9dc81d1c17b108"), __wbg_static_accessor_GLOBAL_THIS_003ee833af9699fc: /* @__PURE__ */ __name(function() {
    let e = typeof globalThis > "u" ? void 0 : globalThis;
    return u(e) ? 0 : l(e);
  }, "__wbg_static_accessor_GLOBAL_THIS_003ee833af9699fc"), __wbg_static_accessor_GLOBAL_e4293fb22cbe77da: /* @__PURE__ */ __name(function() {
    let e = typeof global > "u" ? void 0 : global;
    return u(e) ? 0 : l(e);
  }, "__wbg_static_accessor_GLOBAL_e4293fb22cbe77da"), __wbg_static_accessor_INIT_STATE_b2269150d11f01e0: /* @__PURE__ */ __name(function() {
    return H;
  }, "__wbg_static_accessor_INIT_STATE_b2269150d11f01e0"), __wbg_static_accessor_SELF_53bb20457401453d: /* @__PURE__ */ __name(function() {
    let e = typeof self > "u" ? void 0 : self;
    return u(e) ? 0 : l(e);
  }, "__wbg_static_accessor_SELF_53bb20457401453d"), __wbg_static_accessor_WINDOW_b5e0810bfecb7feb: /* @__PURE__ */ __name(function() {
    let e = typeof window > "u" ? void 0 : window;
    return u(e) ? 0 : l(e);
  }, "__wbg_static_accessor_WINDOW_b5e0810bfecb7feb"), __wbg_status_cb85b6c8d1769fa1: /* @__PURE__ */ __name(function(e) {
    return e.status;
  }, "__wbg_status_cb85b6c8d1769fa1"), __wbg_storage_00d86055b2dc3100: /* @__PURE__ */ __name(function(e) {
    return e.storage;
  }, "__wbg_storage_00d86055b2dc3100"), __wbg_text_2d9a65a87b992bc0: /* @__PURE__ */ __name(function(e) {
    return e.text();
  }, "__wbg_text_2d9a65a87b992bc0"), __wbg_then_656f253a5dd7d8ea: /* @__PURE__ */ __name(function(e, t, n) {
    return e.then(t, n);
  }, "__wbg_then_656f253a5dd7d8ea"), __wbg_then_e3f7f2d365708be8: /* @__PURE__ */ __name(function(e, t) {
    return e.then(t);
  }, "__wbg_then_e3f7f2d365708be8"), __wbg_url_1be993c7b186415b: /* @__PURE__ */ __name(function(e, t) {
    let n = t.url, _ = m(n, i.__wbindgen_malloc, i.__wbindgen_realloc), a = h;
    w().setInt32((e >>> 0) + 4, a, true), w().setInt32((e >>> 0) + 0, _, true);
  }, "__wbg_url_1be993c7b186415b"), __wbg_value_e0f328965e184931: /* @__PURE__ */ __name(function(e) {
    return e.value;
  }, "__wbg_value_e0f328965e184931"), __wbg_view_3b708d3bdaf3fc96: /* @__PURE__ */ __name(function(e) {
    let t = e.view;
    return u(t) ? 0 : l(t);
  }, "__wbg_view_3b708d3bdaf3fc96"), __wbg_waitUntil_0c139a1768f7d284: /* @__PURE__ */ __name(function(e, t) {
    e.waitUntil(t);
  }, "__wbg_waitUntil_0c139a1768f7d284"), __wbg_webSocket_71791e807603b1e4: /* @__PURE__ */ __name(function(e) {
    let t = e.webSocket;
    return u(t) ? 0 : l(t);
  }, "__wbg_webSocket_71791e807603b1e4"), __wbg_writable_1924ab50750acb0f: /* @__PURE__ */ __name(function(e) {
    return e.writable;
  }, "__wbg_writable_1924ab50750acb0f"), __wbindgen_generic_0000000000000001: /* @__PURE__ */ __name(function(e, t) {
    return U(e, t, oe);
  }, "__wbindgen_generic_0000000000000001"), __wbindgen_generic_0000000000000002: /* @__PURE__ */ __name(function(e, t) {
    return U(e, t, se);
  }, "__wbindgen_generic_0000000000000002"), __wbindgen_generic_0000000000000003: /* @__PURE__ */ __name(function(e, t) {
    return U(e, t, ie);
  }, "__wbindgen_generic_0000000000000003"), __wbindgen_generic_0000000000000004: /* @__PURE__ */ __name(function(e) {
    return e;
  }, "__wbindgen_generic_0000000000000004"), __wbindgen_generic_0000000000000005: /* @__PURE__ */ __name(function(e, t) {
    return d(e, t);
  }, "__wbindgen_generic_0000000000000005"), __wbindgen_generic_0000000000000006: /* @__PURE__ */ __name(function(e) {
    return BigInt.asUintN(64, e);
  }, "__wbindgen_generic_0000000000000006"), __wbindgen_init_externref_table: /* @__PURE__ */ __name(function() {
    let e = i.__wbindgen_externrefs;
    e.set(0, void 0), e.set(1024, void 0), e.set(1025, null), e.set(1026, true), e.set(1027, false);
  }, "__wbindgen_init_externref_table"), __wbindgen_jstag: WebAssembly.JSTag, __wbindgen_rethrow_critical: /* @__PURE__ */ __name(function(e) {
    throw new Error("Critical error", { cause: e });
  }, "__wbindgen_rethrow_critical") } };
}
__name(te, "te");
var D = new WebAssembly.Tag({ parameters: ["externref"] });
var q;
var N = false;
function ne() {
  N = true;
  try {
    let r2 = $()[i.__abort_handler.value / 4];
    r2 && i.__wbindgen_export.get(r2)();
  } catch {
  }
}
__name(ne, "ne");
function s(r2) {
  throw r2 instanceof WebAssembly.Exception && r2.is(D) ? r2.getArg(D, 0) : ($()[q] = 1, ne(), r2);
}
__name(s, "s");
function c() {
  if (q ??= i.__instance_terminated.value / 4, $()[q]) {
    if (N || ne(), C) {
      M();
      return;
    }
    throw new Error("Module terminated");
  } else C && M();
}
__name(c, "c");
function ie(r2, e) {
  c();
  try {
    i.wasm_bindgen__convert__closures_____invoke__h5910b4a65368eaae(r2, e);
  } catch (t) {
    s(t);
  }
}
__name(ie, "ie");
function oe(r2, e, t) {
  c();
  try {
    i.wasm_bindgen__convert__closures_____invoke__ha19ccd1fa5e9d7c7(r2, e, t);
  } catch (n) {
    s(n);
  }
}
__name(oe, "oe");
function se(r2, e, t) {
  let n;
  c();
  try {
    n = i.wasm_bindgen__convert__closures_____invoke__h8c0f153fc17a6cc9(r2, e, t);
  } catch (_) {
    s(_);
  }
  if (n[1]) throw ye(n[0]);
}
__name(se, "se");
function ce(r2, e, t, n) {
  c();
  try {
    i.wasm_bindgen__convert__closures_____invoke__h1d58cd14cab36722(r2, e, t, n);
  } catch (_) {
    s(_);
  }
}
__name(ce, "ce");
var ae = ["bytes"];
var fe = ["default", "no-store", "reload", "no-cache", "force-cache", "only-if-cached"];
var ue = ["follow", "error", "manual"];
var o = 0;
var be = typeof FinalizationRegistry > "u" ? { register: /* @__PURE__ */ __name(() => {
}, "register"), unregister: /* @__PURE__ */ __name(() => {
}, "unregister") } : new FinalizationRegistry(({ ptr: r2, instance: e }) => {
  e === o && i.__wbg_containerstartupoptions_free(r2, 1);
});
var de = typeof FinalizationRegistry > "u" ? { register: /* @__PURE__ */ __name(() => {
}, "register"), unregister: /* @__PURE__ */ __name(() => {
}, "unregister") } : new FinalizationRegistry(({ ptr: r2, instance: e }) => {
  e === o && i.__wbg_intounderlyingbytesource_free(r2, 1);
});
var we = typeof FinalizationRegistry > "u" ? { register: /* @__PURE__ */ __name(() => {
}, "register"), unregister: /* @__PURE__ */ __name(() => {
}, "unregister") } : new FinalizationRegistry(({ ptr: r2, instance: e }) => {
  e === o && i.__wbg_intounderlyingsink_free(r2, 1);
});
var ge = typeof FinalizationRegistry > "u" ? { register: /* @__PURE__ */ __name(() => {
}, "register"), unregister: /* @__PURE__ */ __name(() => {
}, "unregister") } : new FinalizationRegistry(({ ptr: r2, instance: e }) => {
  e === o && i.__wbg_intounderlyingsource_free(r2, 1);
});
var G = typeof FinalizationRegistry > "u" ? { register: /* @__PURE__ */ __name(() => {
}, "register"), unregister: /* @__PURE__ */ __name(() => {
}, "unregister") } : new FinalizationRegistry(({ ptr: r2, instance: e }) => {
  e === o && i.__wbg_minifyconfig_free(r2, 1);
});
var le = typeof FinalizationRegistry > "u" ? { register: /* @__PURE__ */ __name(() => {
}, "register"), unregister: /* @__PURE__ */ __name(() => {
}, "unregister") } : new FinalizationRegistry(({ ptr: r2, instance: e }) => {
  e === o && i.__wbg_r2range_free(r2, 1);
});
var K = typeof FinalizationRegistry > "u" ? { register: /* @__PURE__ */ __name(() => {
}, "register"), unregister: /* @__PURE__ */ __name(() => {
}, "unregister") } : new FinalizationRegistry(({ ptr: r2, instance: e }) => {
  e === o && i.__wbg_ratelimitcounter_free(r2, 1);
});
function l(r2) {
  let e = i.__externref_table_alloc();
  return i.__wbindgen_externrefs.set(e, r2), e;
}
__name(l, "l");
var Q = typeof FinalizationRegistry > "u" ? { register: /* @__PURE__ */ __name(() => {
}, "register"), unregister: /* @__PURE__ */ __name(() => {
}, "unregister") } : new FinalizationRegistry((r2) => {
  r2.instance === o && i.__wbindgen_destroy_closure(r2.a, r2.b);
});
function re(r2) {
  switch (typeof r2) {
    case "number":
    case "boolean":
    case "undefined":
      return `${r2}`;
    case "string":
      return JSON.stringify(r2);
    case "bigint":
      return `${r2}n`;
    case "symbol":
      return r2.description !== void 0 ? `Symbol(${r2.description})` : "Symbol";
    case "function":
      return typeof r2.name == "string" && r2.name !== "" ? `Function(${r2.name})` : "Function";
    case "object": {
      if (r2 === null) return "null";
      if (Array.isArray(r2)) return "[" + Array.from(r2, re).join(", ") + "]";
      if (r2 instanceof Error) return `${r2.name}: ${r2.message}
${r2.stack}`;
      let e = toString.call(r2), t = /\[object ([^\]]+)\]/.exec(e)?.[1];
      if (t === void 0) return e;
      if (t === "Object") try {
        return "Object(" + JSON.stringify(r2) + ")";
      } catch {
        return "Object";
      }
      return t;
    }
  }
}
__name(re, "re");
function he(r2, e) {
  r2 = r2 >>> 0;
  let t = w(), n = [];
  for (let _ = r2; _ < r2 + 4 * e; _ += 4) n.push(i.__wbindgen_externrefs.get(t.getUint32(_, true)));
  return i.__externref_drop_slice(r2, e), n;
}
__name(he, "he");
function X(r2, e) {
  return r2 = r2 >>> 0, k().subarray(r2 / 1, r2 / 1 + e);
}
__name(X, "X");
var y = null;
function w() {
  return (y === null || y.buffer.detached === true || y.buffer.detached === void 0 && y.buffer !== i.memory.buffer) && (y = new DataView(i.memory.buffer)), y;
}
__name(w, "w");
var W = null;
function $() {
  return (W === null || W.byteLength === 0) && (W = new Int32Array(i.memory.buffer)), W;
}
__name($, "$");
function d(r2, e) {
  return r2 = r2 >>> 0, me(k().subarray(r2, r2 + e));
}
__name(d, "d");
var S = null;
function k() {
  return (S === null || S.byteLength === 0) && (S = new Uint8Array(i.memory.buffer)), S;
}
__name(k, "k");
function u(r2) {
  return r2 == null;
}
__name(u, "u");
function U(r2, e, t) {
  let n = { a: r2, b: e, cnt: 1, instance: o }, _ = /* @__PURE__ */ __name((...a) => {
    if (n.instance !== o) throw new Error("Cannot invoke closure from previous WASM instance");
    n.cnt++;
    let f = n.a;
    n.a = 0;
    try {
      return t(f, n.b, ...a);
    } finally {
      n.a = f, _._wbg_cb_unref();
    }
  }, "_");
  return _._wbg_cb_unref = () => {
    --n.cnt === 0 && (i.__wbindgen_destroy_closure(n.a, n.b), n.a = 0, Q.unregister(n));
  }, Q.register(_, n, n), _;
}
__name(U, "U");
function pe(r2, e) {
  let t = e(r2.length * 4, 4) >>> 0;
  for (let n = 0; n < r2.length; n++) {
    let _ = l(r2[n]);
    w().setUint32(t + 4 * n, _, true);
  }
  return h = r2.length, t;
}
__name(pe, "pe");
function m(r2, e, t) {
  if (t === void 0) {
    let b = A.encode(r2), g = e(b.length, 1) >>> 0;
    return k().subarray(g, g + b.length).set(b), h = b.length, g;
  }
  let n = r2.length, _ = e(n, 1) >>> 0, a = k(), f = 0;
  for (; f < n; f++) {
    let b = r2.charCodeAt(f);
    if (b > 127) break;
    a[_ + f] = b;
  }
  if (f !== n) {
    f !== 0 && (r2 = r2.slice(f)), _ = t(_, n, n = f + r2.length * 3, 1) >>> 0;
    let b = k().subarray(_ + f, _ + n), g = A.encodeInto(r2, b);
    f += g.written, _ = t(_, n, f, 1) >>> 0;
  }
  return h = f, _;
}
__name(m, "m");
var C = false;
function ye(r2) {
  let e = i.__wbindgen_externrefs.get(r2);
  return i.__externref_table_dealloc(r2), e;
}
__name(ye, "ye");
var _e = new TextDecoder("utf-8", { ignoreBOM: true });
_e.decode();
function me(r2) {
  return _e.decode(r2);
}
__name(me, "me");
var A = new TextEncoder();
"encodeInto" in A || (A.encodeInto = function(r2, e) {
  let t = A.encode(r2);
  return e.set(t), { read: r2.length, written: t.length };
});
var h = 0;
var B = new WebAssembly.Instance(Y, te());
var i = B.exports;
i.__wbindgen_start();
Error.stackTraceLimit = 100;
var p = Z();
function V() {
  p.criticalError && (console.log("Reinitializing Wasm application"), M(), p.criticalError = false, p.instanceId++);
}
__name(V, "V");
addEventListener("error", (r2) => {
  J(r2.error);
});
function J(r2) {
  r2 instanceof WebAssembly.RuntimeError && (console.error("Critical", r2), p.criticalError = true);
}
__name(J, "J");
var L = class extends Ie {
  static {
    __name(this, "L");
  }
};
L.prototype.fetch = function(e) {
  return ee.call(this, e, this.env, this.ctx);
};
var xe = { set: /* @__PURE__ */ __name((r2, e, t, n) => Reflect.set(r2.instance, e, t, n), "set"), has: /* @__PURE__ */ __name((r2, e) => Reflect.has(r2.instance, e), "has"), deleteProperty: /* @__PURE__ */ __name((r2, e) => Reflect.deleteProperty(r2.instance, e), "deleteProperty"), apply: /* @__PURE__ */ __name((r2, e, t) => Reflect.apply(r2.instance, e, t), "apply"), construct: /* @__PURE__ */ __name((r2, e, t) => Reflect.construct(r2.instance, e, t), "construct"), getPrototypeOf: /* @__PURE__ */ __name((r2) => Reflect.getPrototypeOf(r2.instance), "getPrototypeOf"), setPrototypeOf: /* @__PURE__ */ __name((r2, e) => Reflect.setPrototypeOf(r2.instance, e), "setPrototypeOf"), isExtensible: /* @__PURE__ */ __name((r2) => Reflect.isExtensible(r2.instance), "isExtensible"), preventExtensions: /* @__PURE__ */ __name((r2) => Reflect.preventExtensions(r2.instance), "preventExtensions"), getOwnPropertyDescriptor: /* @__PURE__ */ __name((r2, e) => Reflect.getOwnPropertyDescriptor(r2.instance, e), "getOwnPropertyDescriptor"), defineProperty: /* @__PURE__ */ __name((r2, e, t) => Reflect.defineProperty(r2.instance, e, t), "defineProperty"), ownKeys: /* @__PURE__ */ __name((r2) => Reflect.ownKeys(r2.instance), "ownKeys") };
var T = { construct(r2, e, t) {
  try {
    V();
    let n = { instance: Reflect.construct(r2, e, t), instanceId: p.instanceId, ctor: r2, args: e, newTarget: t };
    return new Proxy(n, { ...xe, get(_, a, f) {
      _.instanceId !== p.instanceId && (_.instance = Reflect.construct(_.ctor, _.args, _.newTarget), _.instanceId = p.instanceId);
      let b = Reflect.get(_.instance, a, f);
      return typeof b != "function" ? b : b.constructor === Function ? new Proxy(b, { apply(g, I, F) {
        V();
        try {
          return g.apply(I, F);
        } catch (j) {
          throw J(j), j;
        }
      } }) : new Proxy(b, { async apply(g, I, F) {
        V();
        try {
          return await g.apply(I, F);
        } catch (j) {
          throw J(j), j;
        }
      } });
    } });
  } catch (n) {
    throw p.criticalError = true, n;
  }
} };
var We = new Proxy(L, T);
var Se = new Proxy(x, T);
var ke = new Proxy(v, T);
var Ae = new Proxy(E, T);
var Te = new Proxy(R, T);

// node_modules/wrangler/templates/middleware/middleware-ensure-req-body-drained.ts
var drainBody = /* @__PURE__ */ __name(async (request, env, _ctx, middlewareCtx) => {
  try {
    return await middlewareCtx.next(request, env);
  } finally {
    try {
      if (request.body !== null && !request.bodyUsed) {
        const reader = request.body.getReader();
        while (!(await reader.read()).done) {
        }
      }
    } catch (e) {
      console.error("Failed to drain the unused request body.", e);
    }
  }
}, "drainBody");
var middleware_ensure_req_body_drained_default = drainBody;

// node_modules/wrangler/templates/middleware/middleware-miniflare3-json-error.ts
function reduceError(e) {
  return {
    name: e?.name,
    message: e?.message ?? String(e),
    stack: e?.stack,
    cause: e?.cause === void 0 ? void 0 : reduceError(e.cause)
  };
}
__name(reduceError, "reduceError");
var jsonError = /* @__PURE__ */ __name(async (request, env, _ctx, middlewareCtx) => {
  try {
    return await middlewareCtx.next(request, env);
  } catch (e) {
    const error = reduceError(e);
    return Response.json(error, {
      status: 500,
      headers: { "MF-Experimental-Error-Stack": "true" }
    });
  }
}, "jsonError");
var middleware_miniflare3_json_error_default = jsonError;

// .wrangler/tmp/bundle-6n1WbF/middleware-insertion-facade.js
var __INTERNAL_WRANGLER_MIDDLEWARE__ = [
  middleware_ensure_req_body_drained_default,
  middleware_miniflare3_json_error_default
];
var middleware_insertion_facade_default = We;

// node_modules/wrangler/templates/middleware/common.ts
var __facade_middleware__ = [];
function __facade_register__(...args) {
  __facade_middleware__.push(...args.flat());
}
__name(__facade_register__, "__facade_register__");
function __facade_invokeChain__(request, env, ctx, dispatch, middlewareChain) {
  const [head, ...tail] = middlewareChain;
  const middlewareCtx = {
    dispatch,
    next(newRequest, newEnv) {
      return __facade_invokeChain__(newRequest, newEnv, ctx, dispatch, tail);
    }
  };
  return head(request, env, ctx, middlewareCtx);
}
__name(__facade_invokeChain__, "__facade_invokeChain__");
function __facade_invoke__(request, env, ctx, dispatch, finalMiddleware) {
  return __facade_invokeChain__(request, env, ctx, dispatch, [
    ...__facade_middleware__,
    finalMiddleware
  ]);
}
__name(__facade_invoke__, "__facade_invoke__");

// .wrangler/tmp/bundle-6n1WbF/middleware-loader.entry.ts
var __Facade_ScheduledController__ = class ___Facade_ScheduledController__ {
  constructor(scheduledTime, cron, noRetry) {
    this.scheduledTime = scheduledTime;
    this.cron = cron;
    this.#noRetry = noRetry;
  }
  static {
    __name(this, "__Facade_ScheduledController__");
  }
  #noRetry;
  noRetry() {
    if (!(this instanceof ___Facade_ScheduledController__)) {
      throw new TypeError("Illegal invocation");
    }
    this.#noRetry();
  }
};
function wrapExportedHandler(worker) {
  if (__INTERNAL_WRANGLER_MIDDLEWARE__ === void 0 || __INTERNAL_WRANGLER_MIDDLEWARE__.length === 0) {
    return worker;
  }
  for (const middleware of __INTERNAL_WRANGLER_MIDDLEWARE__) {
    __facade_register__(middleware);
  }
  const fetchDispatcher = /* @__PURE__ */ __name(function(request, env, ctx) {
    if (worker.fetch === void 0) {
      throw new Error("Handler does not export a fetch() function.");
    }
    return worker.fetch(request, env, ctx);
  }, "fetchDispatcher");
  return {
    ...worker,
    fetch(request, env, ctx) {
      const dispatcher = /* @__PURE__ */ __name(function(type, init) {
        if (type === "scheduled" && worker.scheduled !== void 0) {
          const controller = new __Facade_ScheduledController__(
            Date.now(),
            init.cron ?? "",
            () => {
            }
          );
          return worker.scheduled(controller, env, ctx);
        }
      }, "dispatcher");
      return __facade_invoke__(request, env, ctx, dispatcher, fetchDispatcher);
    }
  };
}
__name(wrapExportedHandler, "wrapExportedHandler");
function wrapWorkerEntrypoint(klass) {
  if (__INTERNAL_WRANGLER_MIDDLEWARE__ === void 0 || __INTERNAL_WRANGLER_MIDDLEWARE__.length === 0) {
    return klass;
  }
  for (const middleware of __INTERNAL_WRANGLER_MIDDLEWARE__) {
    __facade_register__(middleware);
  }
  return class extends klass {
    #fetchDispatcher = /* @__PURE__ */ __name((request, env, ctx) => {
      this.env = env;
      this.ctx = ctx;
      if (super.fetch === void 0) {
        throw new Error("Entrypoint class does not define a fetch() function.");
      }
      return super.fetch(request);
    }, "#fetchDispatcher");
    #dispatcher = /* @__PURE__ */ __name((type, init) => {
      if (type === "scheduled" && super.scheduled !== void 0) {
        const controller = new __Facade_ScheduledController__(
          Date.now(),
          init.cron ?? "",
          () => {
          }
        );
        return super.scheduled(controller);
      }
    }, "#dispatcher");
    fetch(request) {
      return __facade_invoke__(
        request,
        this.env,
        this.ctx,
        this.#dispatcher,
        this.#fetchDispatcher
      );
    }
  };
}
__name(wrapWorkerEntrypoint, "wrapWorkerEntrypoint");
var WRAPPED_ENTRY;
if (typeof middleware_insertion_facade_default === "object") {
  WRAPPED_ENTRY = wrapExportedHandler(middleware_insertion_facade_default);
} else if (typeof middleware_insertion_facade_default === "function") {
  WRAPPED_ENTRY = wrapWorkerEntrypoint(middleware_insertion_facade_default);
}
var middleware_loader_entry_default = WRAPPED_ENTRY;
export {
  Se as ContainerStartupOptions,
  ke as MinifyConfig,
  Ae as R2Range,
  Te as RateLimitCounter,
  __INTERNAL_WRANGLER_MIDDLEWARE__,
  middleware_loader_entry_default as default
};
//# sourceMappingURL=index.js.map
