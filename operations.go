package icebergidempotency

import "strings"

// operation is one Iceberg REST mutation, matched by method and by the path
// template after "/v1/{prefix}/" ("*" matches one non-empty segment).
type operation struct {
	method   string
	template []string
	id       string
}

// mutations lists the operations guarded by the handler: the spec's 17
// operations that accept an Idempotency-Key, plus createView, which the spec
// does not list but which is a mutation all the same. reportMetrics, reads and
// OAuth are deliberately absent.
var mutations = []operation{
	{"POST", seg("namespaces"), "createNamespace"},
	{"DELETE", seg("namespaces/*"), "dropNamespace"},
	{"POST", seg("namespaces/*/properties"), "updateProperties"},
	{"POST", seg("namespaces/*/tables"), "createTable"},
	{"POST", seg("namespaces/*/tables/*/plan"), "planTableScan"},
	{"DELETE", seg("namespaces/*/tables/*/plan/*"), "cancelPlanning"},
	{"POST", seg("namespaces/*/tables/*/tasks"), "fetchScanTasks"},
	{"POST", seg("namespaces/*/register"), "registerTable"},
	{"POST", seg("namespaces/*/tables/*"), "updateTable"},
	{"DELETE", seg("namespaces/*/tables/*"), "dropTable"},
	{"POST", seg("namespaces/*/tables/*/unregister"), "unregisterTable"},
	{"POST", seg("tables/rename"), "renameTable"},
	{"POST", seg("transactions/commit"), "commitTransaction"},
	{"POST", seg("namespaces/*/views"), "createView"},
	{"POST", seg("namespaces/*/views/*"), "replaceView"},
	{"DELETE", seg("namespaces/*/views/*"), "dropView"},
	{"POST", seg("views/rename"), "renameView"},
	{"POST", seg("namespaces/*/register-view"), "registerView"},
}

func seg(template string) []string { return strings.Split(template, "/") }

// maxTemplateSegments is the length of the longest template in mutations,
// checked by TestMaxTemplateSegments.
const maxTemplateSegments = 6

// classify returns the operationId of a mutation, or "" for anything that is
// not one. rel is the escaped path below the configured base path, starting
// with "/v1/". The {prefix} segment is optional in deployments, so both
// "/v1/namespaces" and "/v1/{prefix}/namespaces" match; the unprefixed
// reading wins when both would.
func classify(method, rel string) string {
	rest, ok := strings.CutPrefix(rel, "/v1/")
	if !ok {
		return ""
	}
	// No template is longer than maxTemplateSegments, so a longer path is
	// no mutation; the segments of a shorter one go to an array on the
	// stack, which keeps requests that pass through free of allocations.
	n := strings.Count(rest, "/") + 1
	if n > maxTemplateSegments+1 {
		return ""
	}
	var buf [maxTemplateSegments + 1]string
	segs := buf[:0]
	for s := range strings.SplitSeq(rest, "/") {
		segs = append(segs, s)
	}
	if id := match(method, segs); id != "" {
		return id
	}
	if len(segs) > 1 && segs[0] != "" {
		return match(method, segs[1:])
	}
	return ""
}

func match(method string, segs []string) string {
	for _, op := range mutations {
		if op.method != method || len(op.template) != len(segs) {
			continue
		}
		ok := true
		for i, t := range op.template {
			if segs[i] == "" || (t != "*" && t != segs[i]) {
				ok = false
				break
			}
		}
		if ok {
			return op.id
		}
	}
	return ""
}
