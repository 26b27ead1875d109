//go:build !unix

package caddyproc

import "os"

// lockPort reserves nothing across processes off Unix; the in-process
// reservation still keeps one test binary's instances apart.
func lockPort(int) (*os.File, error) { return nil, nil }

func unlockPort(*os.File) {}
