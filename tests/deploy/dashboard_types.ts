// The type that helm/rubato/dashboards/rubato.json must have: @grafana/schema's Dashboard, with
// each panel's options, field config and targets typed by its panel kind (timeseries, stat,
// row) and Prometheus targets spelled out. dashboard.mjs writes the JSON as a literal of this
// type; `tsc --noEmit` then rejects unknown keys (excess property checks) and wrong types.
import type {
  Dashboard,
  DataQuery,
  FieldConfigSource,
  Panel,
  RowPanel,
} from '@grafana/schema';
import type {
  FieldConfig as TimeSeriesFieldConfig,
  Options as TimeSeriesOptions,
} from '@grafana/schema/dist/esm/raw/composable/timeseries/panelcfg/x/TimeSeriesPanelCfg_types.gen';
import type { Options as StatOptions } from '@grafana/schema/dist/esm/raw/composable/stat/panelcfg/x/StatPanelCfg_types.gen';

// JSON holds an enum's value, not the enum: `${E}` turns a string enum into the union of its
// values (FieldColorModeId -> 'palette-classic' | ...); numeric enums accept their numbers.
export type Json<T> = T extends string
  ? `${T}`
  : T extends readonly (infer U)[]
    ? Json<U>[]
    : T extends object
      ? { [K in keyof T]: Json<T[K]> }
      : T;

// Grafana's Prometheus query (its data source plugin's own type is not in @grafana/schema).
export interface PrometheusTarget extends DataQuery {
  expr: string;
  legendFormat?: string;
  range?: boolean;
  instant?: boolean;
  editorMode?: 'code' | 'builder';
  format?: 'time_series' | 'table' | 'heatmap';
  interval?: string;
}

type PanelBase = Omit<Panel, 'type' | 'options' | 'fieldConfig' | 'targets'> & {
  targets: PrometheusTarget[];
};
export type TimeSeriesPanel = PanelBase & {
  type: 'timeseries';
  options: TimeSeriesOptions;
  fieldConfig: FieldConfigSource<TimeSeriesFieldConfig>;
};
export type StatPanel = PanelBase & {
  type: 'stat';
  options: StatOptions;
  fieldConfig: FieldConfigSource;
};

export type RubatoDashboard = Json<
  Omit<Dashboard, 'panels'> & { panels: Array<TimeSeriesPanel | StatPanel | RowPanel> }
>;
