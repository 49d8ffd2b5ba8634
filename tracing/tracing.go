// Package tracing is the relay's OpenTelemetry tracing (W3C Trace
// Context). Provider sets up the SDK from the standard OTEL_* environment,
// which the relay's flags override; Records makes one span per record
// whose event carries a traceparent header (the writer in package outbox
// puts the caller's there), from the source transaction's commit to
// Kafka's acknowledgement, and writes that span's context into the
// record's traceparent, so the consumer's span is the relay's child.
//
// Tracing is off unless an exporter is configured; then no Records exists,
// and the publisher's hot path pays one nil check per record.
package tracing

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"strconv"
	"strings"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracegrpc"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
)

// Config is what the relay's tracing flags and the OpenTelemetry
// environment say. An empty field takes the OTEL_* variable's value (see
// WithEnv), then the SDK's default.
type Config struct {
	// Exporter is OTEL_TRACES_EXPORTER: none (the default: tracing off)
	// or otlp.
	Exporter string
	// Endpoint is the collector's URL (--otel-exporter-otlp-endpoint):
	// for http/protobuf the base that /v1/traces is added to, for grpc
	// the collector's address. Left empty, the exporter reads
	// OTEL_EXPORTER_OTLP_TRACES_ENDPOINT and OTEL_EXPORTER_OTLP_ENDPOINT
	// itself, with the precedence the specification gives them, which
	// WithEnv would lose by copying the generic one here.
	Endpoint string
	// Protocol is OTEL_EXPORTER_OTLP_PROTOCOL: http/protobuf (the
	// default) or grpc.
	Protocol string
	// ServiceName is OTEL_SERVICE_NAME; default outbox-relay.
	ServiceName string
	// Sampler and SamplerArg are OTEL_TRACES_SAMPLER and its argument:
	// always_on, always_off, traceidratio, parentbased_always_on (the
	// default), parentbased_always_off or parentbased_traceidratio, whose
	// ratio SamplerArg is (default 1).
	Sampler, SamplerArg string
}

// The exporters and protocols Config takes.
const (
	ExporterNone     = "none"
	ExporterOTLP     = "otlp"
	ProtocolHTTP     = "http/protobuf"
	ProtocolGRPC     = "grpc"
	defaultService   = "outbox-relay"
	defaultSampler   = "parentbased_always_on"
	tracesURLPath    = "/v1/traces"
	protocolFallback = ProtocolHTTP
)

// Flags names, per field, the flag that sets it, for errors.
var Flags = struct{ Exporter, Endpoint, Protocol, ServiceName, Sampler, SamplerArg string }{
	"--otel-traces-exporter", "--otel-exporter-otlp-endpoint", "--otel-exporter-otlp-protocol",
	"--otel-service-name", "--otel-traces-sampler", "--otel-traces-sampler-arg",
}

// WithEnv fills the fields left empty from the OTEL_* variables getenv
// reads (os.Getenv in the relay); the endpoint is left to the exporter.
func (c Config) WithEnv(getenv func(string) string) Config {
	fill := func(field *string, names ...string) {
		for _, name := range names {
			if *field == "" {
				*field = strings.TrimSpace(getenv(name))
			}
		}
	}
	fill(&c.Exporter, "OTEL_TRACES_EXPORTER")
	fill(&c.Protocol, "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")
	fill(&c.ServiceName, "OTEL_SERVICE_NAME")
	fill(&c.Sampler, "OTEL_TRACES_SAMPLER")
	fill(&c.SamplerArg, "OTEL_TRACES_SAMPLER_ARG")
	return c
}

// Enabled says whether the config turns tracing on.
func (c Config) Enabled() bool { return c.Exporter != "" && c.Exporter != ExporterNone }

// Validate checks every field, with errors that name the flag and say what
// it takes.
func (c Config) Validate() error {
	switch c.Exporter {
	case "", ExporterNone, ExporterOTLP:
	default:
		return fmt.Errorf("%s (OTEL_TRACES_EXPORTER) %q: use otlp, or none to turn tracing off", Flags.Exporter, c.Exporter)
	}
	switch c.Protocol {
	case "", ProtocolHTTP, ProtocolGRPC:
	default:
		return fmt.Errorf("%s (OTEL_EXPORTER_OTLP_PROTOCOL) %q: use http/protobuf or grpc", Flags.Protocol, c.Protocol)
	}
	if c.Endpoint != "" {
		u, err := url.Parse(c.Endpoint)
		if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
			return fmt.Errorf("%s %q: want a URL such as http://127.0.0.1:4318 (http/protobuf) or http://127.0.0.1:4317 (grpc)", Flags.Endpoint, c.Endpoint)
		}
	}
	if _, err := c.sampler(); err != nil {
		return err
	}
	return nil
}

// sampler is the SDK sampler Sampler and SamplerArg name.
func (c Config) sampler() (sdktrace.Sampler, error) {
	ratio := 1.0
	if c.SamplerArg != "" {
		r, err := strconv.ParseFloat(c.SamplerArg, 64)
		if err != nil || r < 0 || r > 1 {
			return nil, fmt.Errorf("%s (OTEL_TRACES_SAMPLER_ARG) %q: want a ratio from 0 to 1, e.g. 0.01", Flags.SamplerArg, c.SamplerArg)
		}
		ratio = r
	}
	name := c.Sampler
	if name == "" {
		name = defaultSampler
	}
	switch name {
	case "always_on":
		return sdktrace.AlwaysSample(), nil
	case "always_off":
		return sdktrace.NeverSample(), nil
	case "traceidratio":
		return sdktrace.TraceIDRatioBased(ratio), nil
	case "parentbased_always_on":
		return sdktrace.ParentBased(sdktrace.AlwaysSample()), nil
	case "parentbased_always_off":
		return sdktrace.ParentBased(sdktrace.NeverSample()), nil
	case "parentbased_traceidratio":
		return sdktrace.ParentBased(sdktrace.TraceIDRatioBased(ratio)), nil
	}
	return nil, fmt.Errorf("%s (OTEL_TRACES_SAMPLER) %q: use always_on, always_off, traceidratio, parentbased_always_on, parentbased_always_off or parentbased_traceidratio", Flags.Sampler, c.Sampler)
}

// Provider is the SDK's tracer provider, exporting in batches; nil when
// the config leaves tracing off. Shut it down on exit, within a bounded
// time, so the last spans are sent.
func Provider(ctx context.Context, c Config, version string) (*sdktrace.TracerProvider, error) {
	if err := c.Validate(); err != nil {
		return nil, err
	}
	if !c.Enabled() {
		return nil, nil
	}
	sampler, _ := c.sampler()
	exp, err := c.exporter(ctx)
	if err != nil {
		return nil, err
	}
	service := c.ServiceName
	if service == "" {
		service = defaultService
	}
	// The environment's resource attributes first, so the service name
	// the relay was given wins over OTEL_RESOURCE_ATTRIBUTES' one.
	res, err := resource.New(ctx, resource.WithFromEnv(), resource.WithTelemetrySDK(),
		resource.WithAttributes(attribute.String("service.name", service), attribute.String("service.version", version)))
	if err != nil && res == nil {
		return nil, fmt.Errorf("tracing resource: %w", err)
	}
	return sdktrace.NewTracerProvider(sdktrace.WithBatcher(exp), sdktrace.WithSampler(sampler), sdktrace.WithResource(res)), nil
}

func (c Config) exporter(ctx context.Context) (sdktrace.SpanExporter, error) {
	protocol := c.Protocol
	if protocol == "" {
		protocol = protocolFallback
	}
	var (
		exp sdktrace.SpanExporter
		err error
	)
	switch protocol {
	case ProtocolGRPC:
		var opts []otlptracegrpc.Option
		if c.Endpoint != "" {
			opts = append(opts, otlptracegrpc.WithEndpointURL(c.Endpoint))
		}
		exp, err = otlptracegrpc.New(ctx, opts...)
	default:
		var opts []otlptracehttp.Option
		if c.Endpoint != "" {
			opts = append(opts, otlptracehttp.WithEndpointURL(strings.TrimRight(c.Endpoint, "/")+tracesURLPath))
		}
		exp, err = otlptracehttp.New(ctx, opts...)
	}
	if err != nil {
		return nil, fmt.Errorf("tracing exporter (%s): %w", protocol, err)
	}
	return exp, nil
}

// Shutdown flushes and stops tp within timeout; a nil tp does nothing.
func Shutdown(tp *sdktrace.TracerProvider, timeout time.Duration) error {
	if tp == nil {
		return nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	if err := tp.Shutdown(ctx); err != nil {
		if errors.Is(err, context.DeadlineExceeded) {
			return fmt.Errorf("tracing: gave up sending the last spans after %s; is the collector at the configured endpoint up?", timeout)
		}
		return fmt.Errorf("tracing shutdown: %w", err)
	}
	return nil
}
