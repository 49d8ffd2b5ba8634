package main

import (
	"context"
	"flag"
	"os"
	"time"

	"github.com/rs/zerolog"
	"go.opentelemetry.io/otel"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"

	"github.com/outbox-relay/outbox-relay/tracing"
)

// tracingFlags map to OpenTelemetry's standard environment, which fills
// whatever they leave unset: operators who trace other services already
// set OTEL_*, and the flags, OUTBOX_RELAY_OTEL_* and the config file win
// over it for this process alone.
func tracingFlags(fs *flag.FlagSet, o *options) {
	c := &o.tracing
	fs.StringVar(&c.Exporter, "otel-traces-exporter", "", "trace export (OTEL_TRACES_EXPORTER): otlp, or none (default: tracing off); with otlp, each event the sampler picks gets a span from its commit to Kafka's ack, the child of the writer's span when its row carries a traceparent header, and its record carries that span's context (see docs/tracing.md)")
	fs.StringVar(&c.Endpoint, "otel-exporter-otlp-endpoint", "", "OTLP collector URL (OTEL_EXPORTER_OTLP_ENDPOINT), e.g. http://127.0.0.1:4318 for http/protobuf, http://127.0.0.1:4317 for grpc (default: the exporter's, localhost)")
	fs.StringVar(&c.Protocol, "otel-exporter-otlp-protocol", "", "OTLP protocol (OTEL_EXPORTER_OTLP_PROTOCOL): http/protobuf or grpc (default http/protobuf)")
	fs.StringVar(&c.ServiceName, "otel-service-name", "", "the spans' service.name (OTEL_SERVICE_NAME; default outbox-relay)")
	fs.StringVar(&c.Sampler, "otel-traces-sampler", "", "sampler (OTEL_TRACES_SAMPLER): parentbased_always_on (the default: every event, as the child of the writer's span when it has one), parentbased_always_off (only events whose writer sampled its span), parentbased_traceidratio (those, and a fraction of the rest), traceidratio, always_on, always_off")
	fs.StringVar(&c.SamplerArg, "otel-traces-sampler-arg", "", "the ratio samplers' fraction (OTEL_TRACES_SAMPLER_ARG), 0 to 1, e.g. 0.01")
}

// tracingShutdownTimeout bounds sending the last spans at exit, so a
// collector that is down cannot hold a stopping relay.
const tracingShutdownTimeout = 5 * time.Second

// startTracing reads the tracing settings with the OpenTelemetry
// environment below them and, when they turn tracing on, makes the
// provider and gives the publisher its span maker. stop flushes and shuts
// the provider down. A bad setting is a usage error that names its flag.
func startTracing(ctx context.Context, o *options, log zerolog.Logger) (stop func(), err error) {
	o.tracing = o.tracing.WithEnv(os.Getenv)
	tp, err := tracing.Provider(ctx, o.tracing, versionString())
	if err != nil || tp == nil {
		return func() {}, err
	}
	// The SDK reports a failed export to the global handler, which prints
	// plain text to stderr; the journal should get one JSON line that
	// says what to check. main is the one place that may set it.
	otel.SetErrorHandler(otel.ErrorHandlerFunc(func(err error) {
		log.Warn().Err(err).Msg("tracing: spans were not exported; check that the collector at the OTLP endpoint is up and reachable")
	}))
	o.kafka.Tracing = tracing.NewRecords(tp, o.source, o.relay.DeliveryMode())
	log.Info().Str("protocol", orDefault(o.tracing.Protocol, tracing.ProtocolHTTP)).Str("sampler", orDefault(o.tracing.Sampler, "parentbased_always_on")).
		Msg("tracing on: each event the sampler picks gets a span from commit to ack")
	return func() { shutdownTracing(tp, log) }, nil
}

func shutdownTracing(tp *sdktrace.TracerProvider, log zerolog.Logger) {
	if err := tracing.Shutdown(tp, tracingShutdownTimeout); err != nil {
		log.Warn().Err(err).Msg("some trace spans were not sent")
	}
}

func orDefault(s, def string) string {
	if s == "" {
		return def
	}
	return s
}
