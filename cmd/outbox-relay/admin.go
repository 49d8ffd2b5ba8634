package main

import (
	"fmt"
	"net"
	"net/http"
	"time"

	"github.com/rs/zerolog"
)

// serveAdmin serves a source's admin endpoint on addr (--admin-addr) until
// the returned stop is called; an empty addr serves nothing. Listening
// happens before it returns, so a taken address is a usage error at start.
func serveAdmin(addr string, h http.Handler, log zerolog.Logger) (stop func(), err error) {
	if addr == "" {
		return func() {}, nil
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("--admin-addr %s: %w (choose a free address, or empty to disable)", addr, err)
	}
	srv := &http.Server{Handler: h, ReadHeaderTimeout: 5 * time.Second}
	served := make(chan struct{})
	go func() {
		defer close(served)
		srv.Serve(ln)
	}()
	log.Info().Str("admin_addr", ln.Addr().String()).Msg("admin endpoint listening")
	return func() {
		srv.Close()
		<-served
	}, nil
}
