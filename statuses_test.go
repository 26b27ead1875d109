package icebergidempotency

import "testing"

func TestShouldFinalizeDefaults(t *testing.T) {
	h := &Handler{}
	h.setDefaults()
	var err error
	if h.finalizeSet, err = parseStatusSet(h.FinalizeStatuses); err != nil {
		t.Fatal(err)
	}
	if h.releaseSet, err = parseStatusSet(h.ReleaseStatuses); err != nil {
		t.Fatal(err)
	}
	finalized := []int{200, 201, 204, 400, 404, 409, 422}
	released := []int{500, 502, 503, 504, 401, 403, 408, 419, 425, 429, 499, 301, 304, 101}
	for _, s := range finalized {
		if !h.shouldFinalize(s) {
			t.Errorf("status %d released, want finalized", s)
		}
	}
	for _, s := range released {
		if h.shouldFinalize(s) {
			t.Errorf("status %d finalized, want released", s)
		}
	}
}

func TestShouldFinalizeConfigured(t *testing.T) {
	h := &Handler{}
	var err error
	if h.finalizeSet, err = parseStatusSet([]string{"2XX", "409"}); err != nil {
		t.Fatal(err)
	}
	if h.releaseSet, err = parseStatusSet([]string{"5xx", "201"}); err != nil {
		t.Fatal(err)
	}
	for s, want := range map[int]bool{200: true, 201: false, 409: true, 404: false, 500: false} {
		if got := h.shouldFinalize(s); got != want {
			t.Errorf("shouldFinalize(%d) = %v, want %v", s, got, want)
		}
	}
	for _, bad := range []string{"6xx", "abc", "99", "600", "x"} {
		if _, err := parseStatusSet([]string{bad}); err == nil {
			t.Errorf("parseStatusSet(%q) accepted", bad)
		}
	}
}
